//! The ring all-reduce: its arithmetic worked out by hand, its order of summation, and
//! the same exchange between two nodes over QUIC on loopback.

use std::time::{Duration, Instant};

use yatt_runtime::Node;
use yatt_runtime::{ring_segments, CollectiveError, RingMember, RingSpec};

const T: Duration = Duration::from_secs(10);

async fn node(dir: &std::path::Path, name: &str, seed: Option<&Node>) -> Node {
    let mut b = Node::builder(name).dev_certs(dir);
    if let Some(s) = seed {
        b = b.seed(s.addr());
    }
    b.start().await.unwrap()
}

/// Members `0..hosts.len()`, member `i` on `hosts[i]`, joined into one ring.
/// `role` names the members' inboxes (`role/i` on their node): rings alive at once on
/// one node need different names.
fn ring(hosts: &[&Node], role: &str, chunk_bytes: u64, timeout: Duration) -> Vec<RingMember> {
    let mut members: Vec<RingMember> = hosts
        .iter()
        .enumerate()
        .map(|(i, n)| RingMember::start(n, role, i as u32).unwrap())
        .collect();
    let ids: Vec<_> = members.iter().map(|m| m.inbox_id().clone()).collect();
    for (rank, m) in members.iter_mut().enumerate() {
        m.join(RingSpec {
            rank: rank as u32,
            members: ids.clone(),
            timeout,
            chunk_bytes,
        })
        .unwrap();
    }
    members
}

/// Joins `members` into one ring again, in their order (a ring rebuilt around a
/// replacement).
fn rejoin(members: &mut [RingMember]) {
    let ids: Vec<_> = members.iter().map(|m| m.inbox_id().clone()).collect();
    for (rank, m) in members.iter_mut().enumerate() {
        m.join(RingSpec {
            rank: rank as u32,
            members: ids.clone(),
            timeout: T,
            chunk_bytes: 4,
        })
        .unwrap();
    }
}

/// Runs one all-reduce on every member at once; returns each member's result.
async fn all_reduce(members: &mut [RingMember], inputs: &[Vec<f32>], round: u64) -> Vec<Vec<f32>> {
    let runs = members.iter_mut().zip(inputs).map(|(m, x)| async move {
        let mut buf = x.clone();
        m.all_reduce_mean(&mut buf, round).await.map(|()| buf)
    });
    futures::future::try_join_all(runs).await.unwrap()
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn segments_split_as_evenly_as_possible() {
    assert_eq!(ring_segments(7, 3), vec![0..3, 3..5, 5..7]);
    assert_eq!(ring_segments(6, 2), vec![0..3, 3..6]);
    // Fewer values than members: the last segments are empty.
    assert_eq!(ring_segments(2, 3), vec![0..1, 1..2, 2..2]);
    assert_eq!(ring_segments(0, 1), vec![0..0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_average_known_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), "ar-a", None).await;
    // One value per chunk: every segment travels as several messages.
    let mut members = ring(&[&n, &n, &n], "ring", 4, T);
    let inputs = vec![
        vec![3.0, 6.0, 9.0, 0.0, -3.0, 1.5, 2.0],
        vec![0.0, 0.0, 0.0, 3.0, 3.0, 1.5, 4.0],
        vec![0.0, 3.0, 6.0, 6.0, 0.0, 1.5, -6.0],
    ];
    // Sums 3, 9, 15, 9, 0, 4.5, 0 over three members, by hand.
    let want = vec![1.0, 3.0, 5.0, 3.0, 0.0, 1.5, 0.0];
    for round in 0..2 {
        for got in all_reduce(&mut members, &inputs, round).await {
            assert_eq!(got, want, "round {round}");
        }
    }
    // One member alone keeps its buffer (the mean of one).
    let mut solo = ring(&[&n], "solo", 4, T);
    let got = all_reduce(&mut solo, &inputs[..1], 0).await;
    assert_eq!(got[0], inputs[0]);
    n.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_member_gets_the_same_bits_in_the_documented_order() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), "ord-a", None).await;
    let mut members = ring(&[&n, &n, &n], "ring", 8, T);
    // 1e8 + 1 rounds back to 1e8 in f32, so the order of the sum shows: segment k is
    // summed starting at member k, ((g_k + g_k+1) + g_k+2), then divided by 3.
    let inputs = vec![vec![1e8f32; 6], vec![1.0; 6], vec![-1e8; 6]];
    // Segment 0: (1e8 + 1) - 1e8 = 0. Segment 1: (1 - 1e8) + 1e8 = 0.
    // Segment 2: (-1e8 + 1e8) + 1 = 1, a third of it 1/3.
    let third = 1.0f32 / 3.0;
    let want = vec![0.0, 0.0, 0.0, 0.0, third, third];
    let first = all_reduce(&mut members, &inputs, 7).await;
    for got in &first {
        assert_eq!(bits(got), bits(&want));
    }
    let again = all_reduce(&mut members, &inputs, 8).await;
    assert_eq!(first, again, "the same inputs gave other bits");
    n.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_on_two_nodes_reduce_over_quic() {
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), "q-a", None).await;
    let b = node(dir.path(), "q-b", Some(&a)).await;
    assert!(
        a.directory()
            .wait_until(T, |d| d.alive_nodes().count() == 2)
            .await
    );
    // Members 0 and 2 on a, member 1 on b: every hop crosses the network. Chunks of
    // 4 KiB: a segment of ~3,300 values is several messages.
    let mut members = ring(&[&a, &b, &a], "ring", 4096, T);
    let len = 10_001;
    let inputs: Vec<Vec<f32>> = (0..3)
        .map(|r| {
            (0..len)
                .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.25 - 12.0)
                .collect()
        })
        .collect();
    let got = all_reduce(&mut members, &inputs, 0).await;
    for i in 0..len {
        let naive = (inputs[0][i] + inputs[1][i] + inputs[2][i]) / 3.0;
        assert!(
            (got[0][i] - naive).abs() < 1e-5,
            "value {i}: {} vs {naive}",
            got[0][i]
        );
    }
    assert_eq!(bits(&got[0]), bits(&got[1]));
    assert_eq!(bits(&got[0]), bits(&got[2]));
    // A member whose buffer differs in length is refused, not mis-added.
    let mut short = inputs.clone();
    short[1].pop();
    let runs = members.iter_mut().zip(&short).map(|(m, x)| async move {
        let mut buf = x.clone();
        m.all_reduce_mean(&mut buf, 1).await
    });
    let results = futures::future::join_all(runs).await;
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(CollectiveError::OutOfStep { .. }))),
        "{results:?}"
    );
    drop(members);
    b.shutdown().await;
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_member_times_out_and_a_bad_spec_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), "to-a", None).await;
    let mut members = ring(&[&n, &n], "ring", 4, Duration::from_millis(300));
    // Member 1 never joins the round: member 0 gives up after its deadline.
    let t0 = Instant::now();
    let mut buf = vec![1.0f32; 8];
    let e = members[0].all_reduce_mean(&mut buf, 0).await.unwrap_err();
    assert!(matches!(e, CollectiveError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // The chunks member 0 sent before giving up are dropped by the next round.
    let inputs = vec![vec![2.0f32; 8], vec![4.0; 8]];
    for got in all_reduce(&mut members, &inputs, 1).await {
        assert_eq!(got, vec![3.0; 8]);
    }
    let mut other = RingMember::start(&n, "ring", 9).unwrap();
    let spec = members[0].spec().unwrap().clone();
    let e = other.join(spec).unwrap_err().to_string();
    assert!(e.contains("this member's inbox"), "{e}");
    let mut fresh = RingMember::start(&n, "ring", 10).unwrap();
    let e = fresh.all_reduce_mean(&mut buf, 0).await.unwrap_err();
    assert!(matches!(e, CollectiveError::NotJoined), "{e}");
    n.shutdown().await;
}

/// A ring rebuilt around a replacement member retries the same round (the round is the
/// policy's version, which a failed step did not advance). What the lost member sent
/// before it died must not be taken for the replacement's: joining drops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_ring_retries_the_same_round_without_the_lost_members_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), "rb-a", None).await;
    let mut members = ring(&[&n, &n], "ring", 4, Duration::from_millis(300));
    // Member 1 sends its part of round 3 to member 0, which never joins that attempt:
    // member 1 gives up (it is "lost"), its chunks still queued at member 0.
    let mut lost = members.pop().unwrap();
    let mut stale = vec![100.0f32; 8];
    let e = lost.all_reduce_mean(&mut stale, 3).await.unwrap_err();
    assert!(matches!(e, CollectiveError::Timeout { .. }), "{e}");
    drop(lost);
    // A replacement takes rank 1 and the ring is joined again; round 3 is retried.
    let replacement = RingMember::start(&n, "ring", 7).unwrap();
    members.push(replacement);
    rejoin(&mut members);
    let inputs = vec![vec![2.0f32; 8], vec![4.0; 8]];
    for got in all_reduce(&mut members, &inputs, 3).await {
        assert_eq!(
            got,
            vec![3.0; 8],
            "the lost member's chunks were averaged in"
        );
    }
    n.shutdown().await;
}

/// Regression: in a ring of four, when member 1 is gone, member 2 (after it) fails at
/// once and member 0 (before it) cannot send, but member 3 waits on member 2, which is
/// alive and gave up: it used to wait out its whole deadline (the trainer's
/// `timeouts.train_s`, 600 s by default). A member that gives up now tells the others,
/// so every survivor fails within moments. The ring rebuilt around a replacement then
/// retries the same round, and the late abandons of the attempt before do not fail it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_gives_up_tells_the_ring_so_no_survivor_waits_out_its_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(dir.path(), "ab-a", None).await;
    let deadline = Duration::from_secs(30);
    let mut members = ring(&[&n, &n, &n, &n], "ring", 4, deadline);
    drop(members.remove(1));
    let t0 = Instant::now();
    let runs = members.iter_mut().map(|m| async move {
        let mut buf = vec![1.0f32; 64];
        let e = m.all_reduce_mean(&mut buf, 5).await.unwrap_err();
        (e, t0.elapsed())
    });
    let failed = futures::future::join_all(runs).await;
    for (e, after) in &failed {
        assert!(after < &Duration::from_secs(10), "{e} after {after:?}");
    }
    let (last, _) = &failed[2];
    assert!(
        matches!(last, CollectiveError::Abandoned { round: 5, .. }),
        "member 3 waited on member 2, which gave up: {last}"
    );
    // A replacement takes rank 1; round 5 is retried on the rebuilt ring.
    members.insert(1, RingMember::start(&n, "ring", 9).unwrap());
    rejoin(&mut members);
    let inputs: Vec<Vec<f32>> = (0..4).map(|i| vec![i as f32; 64]).collect();
    for got in all_reduce(&mut members, &inputs, 5).await {
        assert_eq!(got, vec![1.5; 64]);
    }
    eprintln!(
        "survivors failed after {:?}",
        failed.iter().map(|(_, t)| *t).collect::<Vec<_>>()
    );
    n.shutdown().await;
}

/// Sharded training's halves of the ring: a reduce-scatter leaves member r the sum of
/// segment r (summed in a fixed order, the same bits on every run), and an all-gather
/// hands every member every member's own segment, over QUIC between two nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reduce_scatter_and_all_gather_give_each_member_its_segment_over_quic() {
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), "rs-a", None).await;
    let b = node(dir.path(), "rs-b", Some(&a)).await;
    assert!(
        a.directory()
            .wait_until(T, |d| d.alive_nodes().count() == 2)
            .await
    );
    for n in [2usize, 3, 4] {
        let hosts: Vec<&Node> = (0..n).map(|i| if i % 2 == 0 { &a } else { &b }).collect();
        let mut members = ring(&hosts, &format!("shard{n}"), 4096, T);
        let shard = 2_503;
        let len = shard * n;
        let inputs: Vec<Vec<f32>> = (0..n)
            .map(|r| {
                (0..len)
                    .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.25 - 12.0)
                    .collect()
            })
            .collect();
        let runs = members.iter_mut().zip(&inputs).map(|(m, x)| async move {
            let mut buf = x.clone();
            m.reduce_scatter_sum(&mut buf, 0).await.map(|()| buf)
        });
        let summed = futures::future::try_join_all(runs).await.unwrap();
        let segs = ring_segments(len, n);
        for (r, got) in summed.iter().enumerate() {
            for i in segs[r].clone() {
                let naive: f32 = inputs.iter().map(|x| x[i]).sum();
                assert!((got[i] - naive).abs() < 1e-4, "n={n} member {r} value {i}");
            }
        }
        // The all-gather: each member's own segment is its rank in every value.
        let runs = members.iter_mut().enumerate().map(|(r, m)| {
            let segs = segs.clone();
            async move {
                let mut buf = vec![f32::NAN; len];
                buf[segs[r].clone()].fill(r as f32);
                m.all_gather(&mut buf, 1).await.map(|()| buf)
            }
        });
        let gathered = futures::future::try_join_all(runs).await.unwrap();
        let want: Vec<f32> = (0..len).map(|i| (i / shard) as f32).collect();
        for got in &gathered {
            assert_eq!(bits(got), bits(&want), "n={n}");
        }
        drop(members);
    }
    b.shutdown().await;
    a.shutdown().await;
}

/// Regression (seen once in `roles/tests/sharded_ring.rs`): a member that received its
/// last segment and left at once failed its successor, which still had that member's
/// last chunks queued: the wait for a chunk picked "the previous member is gone" over
/// the queued chunks at random. Queued chunks now come first. Each round here ends with
/// every member leaving the moment its all-gather returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_that_leave_the_moment_they_are_done_fail_no_one() {
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), "leave-a", None).await;
    let b = node(dir.path(), "leave-b", Some(&a)).await;
    assert!(
        a.directory()
            .wait_until(T, |d| d.alive_nodes().count() == 2)
            .await
    );
    for round in 0..200 {
        let members = ring(&[&a, &b, &a], &format!("leave{round}"), 4, T);
        let len = 3 * 16;
        let runs = members
            .into_iter()
            .enumerate()
            .map(|(r, mut m)| async move {
                let mut buf = vec![r as f32; len];
                let out = m.all_gather(&mut buf, 1).await;
                drop(m); // leaves at once
                out
            });
        let results = futures::future::join_all(runs).await;
        for (r, res) in results.iter().enumerate() {
            assert!(res.is_ok(), "round {round}, member {r}: {res:?}");
        }
    }
    b.shutdown().await;
    a.shutdown().await;
}
