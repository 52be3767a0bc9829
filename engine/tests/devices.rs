//! The same bodies on every available device (CPU always, CUDA when present) and dtype.

use yatt_engine::score::token_logprobs;
use yatt_engine::tch::{self, Kind, Tensor};
use yatt_engine::*;

#[test]
fn generate_and_train_on_each_device_and_dtype() {
    tch::set_num_threads(2);
    yatt_engine::test_device!(|dev| {
        let reference = Llama::random(tiny_config(), dev, Kind::Float, 11).unwrap();
        let ids = Tensor::from_slice(&[0i64, 5, 6, 7, 8])
            .unsqueeze(0)
            .to_device(dev);
        let want = tch::no_grad(|| reference.forward(&ids, None));
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let model = reference.deep_copy(dev, kind).unwrap();
            assert_eq!(model.kind(), kind);
            let got = tch::no_grad(|| model.forward(&ids, None)).to_kind(Kind::Float);
            let tol = if kind == Kind::Float { 1e-5 } else { 5e-2 };
            let d = (&got - &want).abs().max().double_value(&[]);
            assert!(d < tol, "{kind:?} on {dev:?}: logits differ by {d}");
            let mut g = Generator::new(
                model,
                GeneratorConfig {
                    max_batch: 2,
                    max_seq_len: 32,
                    ..Default::default()
                },
            );
            let reqs: Vec<Request> = (0..3)
                .map(|i| Request {
                    id: i,
                    prompt: vec![0, 5, 6],
                    params: SamplingParams {
                        max_new_tokens: 6,
                        seed: i,
                        ignore_eos: true,
                        top_p: 0.9,
                        ..Default::default()
                    },
                })
                .collect();
            let (outs, _) = g.generate(&reqs).unwrap();
            assert!(outs.iter().all(|c| c.tokens.len() == 6));
            // A training step with f32 master weights for low-precision models.
            let model = reference.deep_copy(dev, kind).unwrap();
            let mut t = Trainer::new(
                model,
                TrainConfig {
                    lr: 1e-3,
                    ..Default::default()
                },
            );
            let b = SeqBatch::from_pairs(&[(&[0, 5, 6][..], &[7, 8, 9][..])], 1, dev).unwrap();
            let before = t.model.embed.to_kind(Kind::Float).copy();
            let s = t
                .step(&[b], |m, b| {
                    Ok(-token_logprobs(m, b, 1.0, false).logprobs.sum(Kind::Float))
                })
                .unwrap();
            assert!(s.loss.is_finite() && s.grad_norm > 0.0);
            assert!(
                t.model
                    .embed
                    .to_kind(Kind::Float)
                    .not_equal_tensor(&before)
                    .any()
                    .int64_value(&[])
                    == 1,
                "{kind:?}: weights moved"
            );
        }
    });
}
