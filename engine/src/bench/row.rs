//! What the engine benchmarks share: a measured figure, and the sampled requests of the
//! long-tail cases.

use crate::generate::{Request, SamplingParams};

/// One measured figure.
#[derive(Debug, Clone)]
pub struct BenchRow {
    /// What was measured.
    pub case: String,
    /// yatt's figure.
    pub yatt: f64,
    /// The reference figure, when there is one.
    pub reference: Option<f64>,
    /// Unit of both figures.
    pub unit: String,
    /// Notes.
    pub note: String,
}

impl BenchRow {
    /// yatt / reference.
    pub fn ratio(&self) -> Option<f64> {
        self.reference.map(|r| self.yatt / r)
    }
}

/// One request per length in `lens`, over `prompts` in turn: sampled (temperature 1,
/// `top_k`), EOS ignored so each runs its length, a seed per request.
pub(crate) fn sampled_requests(prompts: &[Vec<i64>], lens: &[usize], top_k: usize) -> Vec<Request> {
    lens.iter()
        .enumerate()
        .map(|(i, &l)| Request {
            id: i as u64,
            prompt: prompts[i % prompts.len()].clone(),
            params: SamplingParams {
                temperature: 1.0,
                top_k,
                max_new_tokens: l,
                ignore_eos: true,
                seed: i as u64,
                ..Default::default()
            },
        })
        .collect()
}
