//! Scenarios end to end through the public API: every placement runs, config errors
//! name the key and the fix, and the variants (partial rollouts, lanes) run beside the
//! plain placements.

use yatt_sim::{format_report, run_scenario, ScenarioReport, SimConfig, Strategy};

const SMALL: &str = r#"
[sim]
name = "small"
staleness = 1

[hardware]
gpu = "h100"
gpus = 8
gpus_per_node = 8
group_size = 1

[job]
model = "1b"
reward = "genrm"

[workload]
steps = 4
prompts_per_step = 16
samples_per_prompt = 4
prompt_len = 128
response = { dist = "lognormal", median = 200, sigma = 1.0 }
max_response = 2048
growth = 2.0
dynamic_sampling = { drop_start = 0.2, drop_end = 0.4 }
judge = { dist = "lognormal", median = 60, sigma = 0.5 }
judge_max = 256
"#;

#[test]
fn every_placement_runs_every_step_above_the_bound() {
    let config = SimConfig::parse(SMALL).unwrap();
    let sc = &config.scenarios().unwrap()[0];
    let r = run_scenario(sc).unwrap();
    assert_eq!(r.strategies.len(), 3);
    assert_eq!(r.bound_steps_s.len(), 4);
    for s in &r.strategies {
        assert!(s.refused.is_none(), "{:?}", s.refused);
        assert_eq!(s.steps_s.len(), 4, "{:?}", s.strategy);
        // In-order acceptance makes every placement train the same groups, so none
        // can beat the work they need at full efficiency.
        assert!(
            s.vs_bound >= 1.0,
            "{:?} at {} x bound",
            s.strategy,
            s.vs_bound
        );
        let total = s.compute_frac + s.overhead_frac + s.idle_frac;
        assert!((total - 1.0).abs() < 1e-9, "{total}");
    }
    let colo = r.get(Strategy::Colocate).unwrap();
    assert_eq!(colo.plan, format!("rollout+reward+reference+policy:8"));
    assert_eq!(colo.speedup, Some(1.0));
    // Deterministic: the same config gives the same figures.
    let again = run_scenario(sc).unwrap();
    assert_eq!(again, r);
}

#[test]
fn config_errors_name_the_key() {
    let bad = SMALL.replace("reward = \"genrm\"", "reward = \"llm\"");
    let err = SimConfig::parse(&bad).unwrap_err().to_string();
    assert!(
        err.contains("job.reward") && err.contains("\"llm\""),
        "{err}"
    );
    let bad = SMALL.replace("gpu = \"h100\"", "gpu = \"h100\"\ngpus_per_rack = 4");
    let err = SimConfig::parse(&bad).unwrap_err().to_string();
    assert!(err.contains("gpus_per_rack"), "{err}");
    let bad = SMALL.replace("group_size = 1", "group_size = 3");
    let err = SimConfig::parse(&bad).unwrap_err().to_string();
    assert!(err.contains("group_size (3)"), "{err}");
    let bad = SMALL.replace("model = \"1b\"", "model = \"13b\"");
    let err = SimConfig::parse(&bad).unwrap_err().to_string();
    assert!(err.contains("13b") && err.contains("70b"), "{err}");
}

#[test]
fn partial_rollout_errors_name_the_key_and_the_fix() {
    let with = |pr: &str| {
        SMALL.replace(
            "judge_max = 256",
            &format!("judge_max = 256\npartial_rollout = {pr}"),
        )
    };
    for (value, wants) in [
        (
            "{ cutoff = 0 }",
            ["workload.partial_rollout.cutoff", "cutoff = 0.9"],
        ),
        (
            "{ reserve = 2 }",
            ["workload.partial_rollout.reserve", "raise sim.staleness"],
        ),
        ("{ resume = \"swap\" }", ["swap", "reprefill"]),
    ] {
        let err = SimConfig::parse(&with(value)).unwrap_err().to_string();
        assert!(wants.iter().all(|w| err.contains(w)), "{value}: {err}");
    }
    let ok = SimConfig::parse(&with(
        "{ cutoff = 0.7, resume = \"reprefill\", beyond_bound = \"regenerate\" }",
    ));
    assert!(ok.is_ok(), "{:?}", ok.err());
}

/// Runs `SMALL` with two text replacements (`(from, to)`).
fn small_with(a: (&str, &str), b: (&str, &str)) -> ScenarioReport {
    let text = SMALL.replace(a.0, a.1).replace(b.0, b.1);
    let config = SimConfig::parse(&text).unwrap();
    run_scenario(&config.scenarios().unwrap()[0]).unwrap()
}

#[test]
fn partial_rollouts_run_beside_the_plain_placements() {
    let r = small_with(
        ("staleness = 1", "staleness = 1\nwithout_partial = true"),
        (
            "judge_max = 256",
            "judge_max = 256\npartial_rollout = { cutoff = 0.7 }",
        ),
    );
    assert_eq!(r.strategies.len(), 6);
    for s in &r.strategies {
        assert!(s.refused.is_none(), "{:?}", s.refused);
        assert!(
            s.vs_bound >= 1.0,
            "{:?} {} at {}",
            s.strategy,
            s.partial,
            s.vs_bound
        );
        assert!(s.max_lag <= 1, "{:?}: lag {}", s.strategy, s.max_lag);
    }
    let colo = r
        .strategies
        .iter()
        .find(|s| s.strategy == Strategy::Colocate && s.partial)
        .unwrap();
    assert_eq!(colo.speedup, Some(1.0), "compared like for like");
    assert!(colo.speedup_vs_on_policy.is_some());
}

#[test]
fn a_model_that_fits_nowhere_is_refused_with_the_reason() {
    let big = SMALL.replace("model = \"1b\"", "model = \"70b\"");
    let config = SimConfig::parse(&big).unwrap();
    let err = run_scenario(&config.scenarios().unwrap()[0])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no placement fits") && err.contains("GiB"),
        "{err}"
    );
}

#[test]
fn lane_config_errors_name_the_key_and_the_fix() {
    let with = |policy: &str, sim: &str| {
        SMALL
            .replace("staleness = 1", &format!("staleness = 1\n{sim}"))
            .replace("[hardware]", &format!("[policy]\n{policy}\n\n[hardware]"))
    };
    let err = |policy: &str, sim: &str| match SimConfig::parse(&with(policy, sim)) {
        Ok(_) => panic!("{policy} {sim}: accepted"),
        Err(e) => e.to_string(),
    };
    for (policy, sim, want) in [
        (
            "lanes = { batch = 0 }",
            "",
            &["policy.lanes.batch: found 0", "batch = 8"][..],
        ),
        (
            "lanes = { batch = 8, threshold = 2048 }",
            "",
            &["policy.lanes.threshold: found 2048", "(2047)"],
        ),
        ("lanes = { batch = 8, size = 2 }", "", &["size"]),
        (
            "",
            "without_lanes = true",
            &["sim.without_lanes", "policy.lanes"],
        ),
    ] {
        let e = err(policy, sim);
        assert!(want.iter().all(|w| e.contains(w)), "{e}");
    }
    SimConfig::parse(&with(
        "lanes = { batch = 8, threshold = 512 }",
        "without_lanes = true",
    ))
    .unwrap();
}

#[test]
fn lanes_run_beside_the_placements_without_them() {
    let r = small_with(
        ("staleness = 1", "staleness = 1\nwithout_lanes = true"),
        (
            "[hardware]",
            "[policy]\nlanes = { batch = 4 }\n\n[hardware]",
        ),
    );
    let names: Vec<(Strategy, bool)> = r.strategies.iter().map(|s| (s.strategy, s.lanes)).collect();
    assert_eq!(
        names,
        vec![
            (Strategy::Colocate, false),
            (Strategy::Static, false),
            (Strategy::Dynamic, false),
            (Strategy::Static, true),
            (Strategy::Dynamic, true),
        ]
    );
    for s in &r.strategies {
        assert!(s.refused.is_none(), "{:?}", s.refused);
        assert!(s.vs_bound >= 1.0, "{:?} at {}", s.strategy, s.vs_bound);
        if !s.lanes {
            assert_eq!(s.lane_moves, 0);
        }
    }
    // The static split with leave to use lanes is the best of a superset of plans.
    let st = |lanes: bool| {
        r.strategies
            .iter()
            .find(|s| s.strategy == Strategy::Static && s.lanes == lanes)
            .unwrap()
            .step_s
    };
    assert!(st(true) <= st(false) + 1e-9);
    assert!(r.get(Strategy::Dynamic).unwrap().lanes);
    assert!(!r.get(Strategy::Colocate).unwrap().lanes);
    assert!(format_report(&r).contains("dynamic+lanes"));
}
