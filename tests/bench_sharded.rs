//! `yatt bench sharded` as real processes: ranks on their own nodes over the QUIC ring
//! train the tiny model sharded and replicated; the sharded rows move what the
//! trainer's schedule says (under 3·(N−1)/N·Ψ·b), leave exposed at most the gather
//! time they spent, and every layout reports the same first loss; the sharded rows
//! carry the cost model's predicted step.

use std::process::Command;

#[test]
fn sharded_and_replicated_ranks_train_as_processes() {
    let out = Command::new(env!("CARGO_BIN_EXE_yatt"))
        .args([
            "bench",
            "sharded",
            "--model",
            "tiny",
            "--shards",
            "1,2",
            "--replicated",
            "2",
        ])
        .args([
            "--steps",
            "2",
            "--global-batch",
            "4",
            "--seq-len",
            "24",
            "--run-s",
            "300",
        ])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "yatt bench sharded failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("| Sharded") || l.starts_with("| Replicated"))
        .map(|l| l.split('|').map(str::trim).collect())
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    // Columns: layout, ranks, step, state, peak RSS, RSS built, moved, schedule (the
    // cost model's), the formula, gather, exposed gather, loss, ring probe,
    // core share, predicted step, measured step, their ratio, the ratio at the probed
    // share.
    assert!(rows.iter().all(|r| r.len() == 20), "{stdout}");
    let losses: Vec<f64> = rows.iter().map(|r| r[12].parse().unwrap()).collect();
    for l in &losses {
        assert!((l - losses[0]).abs() < 1e-5 * losses[0].abs(), "{stdout}");
    }
    for r in rows.iter().filter(|r| r[1] == "Sharded") {
        let moved: f64 = r[7].parse().unwrap();
        let schedule: f64 = r[8].parse().unwrap();
        let formula: f64 = r[9].parse().unwrap();
        assert!((moved - schedule).abs() <= 0.1, "{stdout}");
        assert!(moved <= formula + 0.1, "{stdout}");
        let gather: f64 = r[10].parse().unwrap();
        let exposed: f64 = r[11].parse().unwrap();
        assert!(exposed <= gather + 0.001, "{stdout}");
        // The state each rank holds (GB, three decimals: the tiny model shows as 0.00x).
        assert!(r[4].parse::<f64>().unwrap() > 0.0, "{stdout}");
        // A prediction and its ratio to the step (the tiny model's step is latency, so
        // no bound on the ratio here), and a probed ring where there is one.
        assert!(r[15].contains(" = "), "{stdout}");
        assert!(r[17].parse::<f64>().unwrap() > 0.0, "{stdout}");
        assert!(r[18].parse::<f64>().unwrap() > 0.0, "{stdout}");
        if r[2] != "1" {
            assert!(r[13].parse::<f64>().unwrap() > 0.0, "{stdout}");
        }
    }
}
