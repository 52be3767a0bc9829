//! The calculator tool: arithmetic expressions (`+ - * /`, parentheses, unary minus,
//! integers and decimals) evaluated by a small recursive-descent parser. Nothing is
//! executed: an expression is data, and anything else is refused with the reason.

use serde_json::{Map, Value};

use crate::env::api::{Tool, ToolError};

/// Longest expression accepted, characters (bounds the parser's work and recursion).
const MAX_EXPRESSION_CHARS: usize = 256;
/// Deepest parenthesis nesting accepted.
const MAX_DEPTH: usize = 32;

/// Evaluates an arithmetic expression. Errors say what was wrong, at which character.
pub fn evaluate_expression(text: &str) -> Result<f64, String> {
    if text.chars().count() > MAX_EXPRESSION_CHARS {
        return Err(format!(
            "the expression is longer than {MAX_EXPRESSION_CHARS} characters"
        ));
    }
    let mut p = Parser {
        chars: text.chars().collect(),
        pos: 0,
        depth: 0,
    };
    let v = p.sum()?;
    p.skip_spaces();
    if p.pos < p.chars.len() {
        return Err(format!(
            "unexpected {:?} at character {}; only numbers, + - * / and parentheses are allowed",
            p.chars[p.pos],
            p.pos + 1
        ));
    }
    if !v.is_finite() {
        return Err("the result is not a finite number".into());
    }
    Ok(v)
}

/// A number as a calculator shows it: integers without a decimal point, others with
/// at most 10 significant decimals.
pub fn format_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        let s = format!("{v:.10}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn skip_spaces(&mut self) {
        while self.chars.get(self.pos).is_some_and(|c| c.is_whitespace()) {
            self.pos += 1;
        }
    }

    fn peek(&mut self) -> Option<char> {
        self.skip_spaces();
        self.chars.get(self.pos).copied()
    }

    /// sum := product (('+' | '-') product)*
    fn sum(&mut self) -> Result<f64, String> {
        let mut v = self.product()?;
        while let Some(op @ ('+' | '-')) = self.peek() {
            self.pos += 1;
            let r = self.product()?;
            v = if op == '+' { v + r } else { v - r };
        }
        Ok(v)
    }

    /// product := unary (('*' | '/' | '×' | '÷') unary)*
    fn product(&mut self) -> Result<f64, String> {
        let mut v = self.unary()?;
        while let Some(op @ ('*' | '/' | '×' | '÷' | 'x')) = self.peek() {
            self.pos += 1;
            let r = self.unary()?;
            v = match op {
                '/' | '÷' if r == 0.0 => return Err("division by zero".into()),
                '/' | '÷' => v / r,
                _ => v * r,
            };
        }
        Ok(v)
    }

    /// unary := '-' unary | '+' unary | atom
    fn unary(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some('-') => {
                self.pos += 1;
                self.nested(|p| p.unary()).map(|v| -v)
            }
            Some('+') => {
                self.pos += 1;
                self.nested(|p| p.unary())
            }
            _ => self.atom(),
        }
    }

    fn nested(&mut self, f: impl FnOnce(&mut Self) -> Result<f64, String>) -> Result<f64, String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("nested deeper than {MAX_DEPTH} levels"));
        }
        let v = f(self);
        self.depth -= 1;
        v
    }

    /// atom := number | '(' sum ')'
    fn atom(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some('(') => {
                self.pos += 1;
                let v = self.nested(|p| p.sum())?;
                if self.peek() != Some(')') {
                    return Err(format!("missing ')' at character {}", self.pos + 1));
                }
                self.pos += 1;
                Ok(v)
            }
            Some(c) if c.is_ascii_digit() || c == '.' => {
                let start = self.pos;
                while self
                    .chars
                    .get(self.pos)
                    .is_some_and(|c| c.is_ascii_digit() || *c == '.' || *c == ',' || *c == '_')
                {
                    self.pos += 1;
                }
                // Thousands separators are common in model text: 1,234 or 1_234.
                let s: String = self.chars[start..self.pos]
                    .iter()
                    .filter(|c| **c != ',' && **c != '_')
                    .collect();
                s.parse::<f64>()
                    .map_err(|_| format!("{s:?} at character {} is not a number", start + 1))
            }
            Some(c) => Err(format!(
                "unexpected {c:?} at character {}; only numbers, + - * / and parentheses are allowed",
                self.pos + 1
            )),
            None => Err("the expression ends where a number was expected".into()),
        }
    }
}

/// The calculator as a tool: `{"expression": "12*34"}` → `408`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CalculatorTool;

impl Tool for CalculatorTool {
    fn name(&self) -> &str {
        "calculator"
    }

    fn description(&self) -> &str {
        "calculator: evaluates arithmetic (+ - * / and parentheses)"
    }

    fn example_question(&self) -> &str {
        "What is 12 * 34?"
    }

    fn example_arguments(&self) -> &str {
        r#"{"expression": "12*34"}"#
    }

    fn example_result(&self) -> &str {
        "408"
    }

    fn call(&mut self, arguments: &Map<String, Value>) -> Result<String, ToolError> {
        let expr = match arguments.get("expression") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            _ => {
                return Err(ToolError::BadArguments(
                    r#"the calculator takes {"expression": "<arithmetic>"}"#.into(),
                ))
            }
        };
        evaluate_expression(&expr)
            .map(format_number)
            .map_err(ToolError::BadArguments)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_arithmetic_and_refuses_everything_else() {
        for (e, v) in [
            ("1234 * 5678", 7006652.0),
            ("2 + 3 * 4", 14.0),
            ("(2 + 3) * 4", 20.0),
            ("-3 - -2", -1.0),
            ("7 / 2", 3.5),
            ("1,234 × 2", 2468.0),
            ("  0.5*4 ", 2.0),
        ] {
            assert_eq!(evaluate_expression(e), Ok(v), "{e}");
        }
        for (e, says) in [
            ("__import__('os')", "unexpected"),
            ("1 / 0", "division by zero"),
            ("(1 + 2", "missing ')'"),
            ("1 +", "ends where a number"),
            ("2 ** 3", "unexpected"),
            ("1.2.3", "not a number"),
        ] {
            let err = evaluate_expression(e).unwrap_err();
            assert!(err.contains(says), "{e}: {err}");
        }
        let deep = format!("{}1{}", "(".repeat(40), ")".repeat(40));
        assert!(evaluate_expression(&deep).unwrap_err().contains("nested"));
        assert!(evaluate_expression(&"1+".repeat(200))
            .unwrap_err()
            .contains("longer"));
        assert_eq!(format_number(7006652.0), "7006652");
        assert_eq!(format_number(3.5), "3.5");
        assert_eq!(format_number(1.0 / 3.0), "0.3333333333");
    }
}
