//! The chaos soak (`ferry-chaos`, issue 17), one minute of it: Poisson load through a front while
//! random faults hit a cluster of real processes. The ten-minute run is `scripts/chaos`.

use std::process::Command;

use ferry_tests::binary;

#[test]
fn a_one_minute_chaos_soak_loses_changes_and_leaks_nothing() {
    let out = Command::new(binary("ferry-chaos").unwrap())
        .args(["--duration", "60", "--fault-every", "2", "--seed", "3", "--json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    let summary: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no summary: {}", String::from_utf8_lossy(&out.stderr)));
    let n = |k: &str| summary[k].as_u64().unwrap_or_else(|| panic!("{k} in {summary}"));
    let faults = summary["faults"].as_object().unwrap();
    let count = |label: &str| faults.get(label).and_then(serde_json::Value::as_u64).unwrap_or(0);
    // What the soak did: enough faults, of the kinds that move work, under enough load.
    assert!(faults.values().filter_map(serde_json::Value::as_u64).sum::<u64>() >= 8, "{summary}");
    assert!(count("kill -9 executor") + count("kill -9 leader scheduler") > 0, "{summary}");
    assert!(n("requests") >= 30, "{summary}");
    assert!(n("moved") > 0, "no request had to move: the faults missed the load");
    // What it must show.
    assert_eq!(n("lost"), 0, "{summary}");
    assert_eq!(n("completed"), n("requests"), "{summary}");
    assert_eq!(n("differing"), 0, "{summary}");
    assert_eq!((n("leaked_blocks"), n("leaked_requests")), (0, 0), "{summary}");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
