//! Slurm's compressed host lists (`SLURM_JOB_NODELIST`), expanded in `scontrol show
//! hostnames` order: `gpu[01-03,07]`, `r[1-2]-n[01-02]`, `a1,b[3-4]`. Pure: no I/O.
//!
//! Grammar: a list is items separated by commas outside brackets; an item is text with
//! any number of `[ranges]` groups; a range is `N` or `LO-HI`. A range whose lower bound
//! has a leading zero is zero-padded to that bound's width (Slurm's rule: `[08-10]`
//! gives `08 09 10`, `[8-10]` gives `8 9 10`). Several groups expand as nested loops,
//! the first outermost (`r[1-2]-n[1-2]`: `r1-n1 r1-n2 r2-n1 r2-n2`).

/// More hosts than any allocation has: a typo such as `[1-1000000000]` is refused
/// instead of filling memory.
pub const MAX_HOSTS: usize = 65_536;

/// Why a host list does not parse; the message says where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeListError {
    /// Nothing to expand.
    #[error("the node list is empty")]
    Empty,
    /// An item between commas is empty (`a,,b`, a trailing comma).
    #[error("empty host name at character {at} (two commas in a row, or a comma at an end)")]
    EmptyItem {
        /// 0-based character offset.
        at: usize,
    },
    /// `[` without its `]`, `]` without its `[`, or `[` inside brackets.
    #[error("unbalanced bracket at character {at}")]
    Bracket {
        /// 0-based character offset.
        at: usize,
    },
    /// A range inside brackets is not `N` or `LO-HI` of decimal digits.
    #[error("`[{range}]`: expected a number or LO-HI of decimal digits, e.g. [01-03,07]")]
    Range {
        /// The offending range text.
        range: String,
    },
    /// `LO-HI` with `LO > HI`.
    #[error("`{range}`: the range runs backwards ({lo} > {hi})")]
    Backwards {
        /// The offending range text.
        range: String,
        /// Its lower bound.
        lo: u64,
        /// Its upper bound.
        hi: u64,
    },
    /// The list expands to more than [`MAX_HOSTS`] hosts.
    #[error("expands to more than {MAX_HOSTS} hosts")]
    TooMany,
}

/// One `[...]` group, expanded: its host-name pieces in order.
fn expand_group(body: &str) -> Result<Vec<String>, NodeListError> {
    let mut out = Vec::new();
    for range in body.split(',') {
        let bad = || NodeListError::Range {
            range: body.to_string(),
        };
        let (lo_s, hi_s) = range.split_once('-').unwrap_or((range, range));
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo_s) || !digits(hi_s) || lo_s.len() > 18 || hi_s.len() > 18 {
            return Err(bad());
        }
        let (lo, hi): (u64, u64) = (
            lo_s.parse().map_err(|_| bad())?,
            hi_s.parse().map_err(|_| bad())?,
        );
        if lo > hi {
            return Err(NodeListError::Backwards {
                range: range.to_string(),
                lo,
                hi,
            });
        }
        if (hi - lo) as usize >= MAX_HOSTS || out.len() + (hi - lo) as usize >= MAX_HOSTS {
            return Err(NodeListError::TooMany);
        }
        let width = if lo_s.starts_with('0') { lo_s.len() } else { 0 };
        out.extend((lo..=hi).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Expands one item (no top-level commas) starting at character `at`.
fn expand_item(item: &str, at: usize) -> Result<Vec<String>, NodeListError> {
    if item.is_empty() {
        return Err(NodeListError::EmptyItem { at });
    }
    let mut hosts = vec![String::new()];
    let mut rest = item;
    let mut pos = at;
    while !rest.is_empty() {
        match rest.find(['[', ']']) {
            None => {
                hosts.iter_mut().for_each(|h| h.push_str(rest));
                rest = "";
            }
            Some(i) if rest.as_bytes()[i] == b']' => {
                return Err(NodeListError::Bracket { at: pos + i });
            }
            Some(i) => {
                let text = &rest[..i];
                let after = &rest[i + 1..];
                let close = after
                    .find(['[', ']'])
                    .filter(|&j| after.as_bytes()[j] == b']')
                    .ok_or(NodeListError::Bracket { at: pos + i })?;
                let pieces = expand_group(&after[..close])?;
                if hosts.len().saturating_mul(pieces.len()) > MAX_HOSTS {
                    return Err(NodeListError::TooMany);
                }
                hosts = hosts
                    .iter()
                    .flat_map(|h| pieces.iter().map(move |p| format!("{h}{text}{p}")))
                    .collect();
                rest = &after[close + 1..];
                pos += i + 1 + close + 1;
            }
        }
    }
    Ok(hosts)
}

/// Expands a Slurm host list into host names, in `scontrol show hostnames` order.
pub fn expand(list: &str) -> Result<Vec<String>, NodeListError> {
    let list = list.trim();
    if list.is_empty() {
        return Err(NodeListError::Empty);
    }
    let mut hosts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    // Split on commas outside brackets; brackets are checked again per item.
    for (i, c) in list.char_indices().chain([(list.len(), ',')]) {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                hosts.extend(expand_item(&list[start..i], start)?);
                if hosts.len() > MAX_HOSTS {
                    return Err(NodeListError::TooMany);
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(NodeListError::Bracket {
            at: list.rfind('[').unwrap_or(0),
        });
    }
    Ok(hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_every_form_slurm_writes() {
        let cases: &[(&str, &[&str])] = &[
            ("node1", &["node1"]),
            ("gpu[01-03,07]", &["gpu01", "gpu02", "gpu03", "gpu07"]),
            ("r[1-2]-n[01-02]", &["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
            ("a1,b[3-4]", &["a1", "b3", "b4"]),
            ("n[001-003]", &["n001", "n002", "n003"]),
            ("n[08-11]", &["n08", "n09", "n10", "n11"]),
            ("n[8-11]", &["n8", "n9", "n10", "n11"]),
            ("n[98-101]", &["n98", "n99", "n100", "n101"]),
            ("n[099-101]", &["n099", "n100", "n101"]),
            ("n[5]", &["n5"]),
            ("[1-2]x", &["1x", "2x"]),
            ("127.0.0.[1-3]", &["127.0.0.1", "127.0.0.2", "127.0.0.3"]),
            (
                "gpu[1-2],cpu[07-08],login",
                &["gpu1", "gpu2", "cpu07", "cpu08", "login"],
            ),
            ("  a[1-2]\n", &["a1", "a2"]),
            ("r[1,3]-n[9-10]", &["r1-n9", "r1-n10", "r3-n9", "r3-n10"]),
        ];
        for (list, want) in cases {
            assert_eq!(expand(list).unwrap(), *want, "{list}");
        }
    }

    #[test]
    fn refuses_malformed_lists_saying_where() {
        let cases: &[(&str, NodeListError)] = &[
            ("", NodeListError::Empty),
            ("   ", NodeListError::Empty),
            ("a,,b", NodeListError::EmptyItem { at: 2 }),
            ("a,", NodeListError::EmptyItem { at: 2 }),
            (",a", NodeListError::EmptyItem { at: 0 }),
            ("gpu[01-03", NodeListError::Bracket { at: 3 }),
            ("gpu01-03]", NodeListError::Bracket { at: 8 }),
            ("gpu[[1-2]]", NodeListError::Bracket { at: 3 }),
            ("gpu[]", NodeListError::Range { range: "".into() }),
            (
                "gpu[a-b]",
                NodeListError::Range {
                    range: "a-b".into(),
                },
            ),
            ("gpu[1-]", NodeListError::Range { range: "1-".into() }),
            (
                "gpu[1-2-3]",
                NodeListError::Range {
                    range: "1-2-3".into(),
                },
            ),
            (
                "gpu[1,,2]",
                NodeListError::Range {
                    range: "1,,2".into(),
                },
            ),
            (
                "gpu[5-3]",
                NodeListError::Backwards {
                    range: "5-3".into(),
                    lo: 5,
                    hi: 3,
                },
            ),
            ("n[0-99999999999]", NodeListError::TooMany),
            ("n[0-999]-m[0-999]", NodeListError::TooMany),
        ];
        for (list, want) in cases {
            assert_eq!(expand(list).as_ref(), Err(want), "{list:?}");
        }
    }

    #[test]
    fn errors_read_as_sentences() {
        let e = expand("gpu[5-3]").unwrap_err().to_string();
        assert!(e.contains("5-3") && e.contains("backwards"), "{e}");
    }
}
