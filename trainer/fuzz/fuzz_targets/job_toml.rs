//! Arbitrary UTF-8 as a job config: `JobConfig::parse` (TOML, `--set` overrides, the
//! typed sections, validation). The text up to the first NUL is the file; each
//! NUL-separated piece after it (at most 8) is a `--set key=value` argument. An accepted
//! config must survive the trip yatt makes it take to cluster nodes and to a run's
//! job.toml: it encodes as TOML, and that text parses again to the same encoding.
//! Nothing may panic or allocate without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use yatt_trainer::JobConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut pieces = text.split('\0');
    let file = pieces.next().unwrap_or_default();
    let sets: Vec<String> = pieces.take(8).map(String::from).collect();
    let Ok(job) = JobConfig::parse(file, "fuzz.toml", &sets) else {
        return;
    };
    let encoded = toml::to_string(&job).expect("an accepted job config encodes as TOML");
    let again = JobConfig::parse(&encoded, "round-trip.toml", &[])
        .unwrap_or_else(|e| panic!("an accepted job config does not parse again: {e}\n{encoded}"));
    assert_eq!(
        toml::to_string(&again).unwrap(),
        encoded,
        "the round trip changed the config"
    );
});
