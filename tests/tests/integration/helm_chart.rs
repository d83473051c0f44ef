//! The Helm chart's tests (`helm/tests/run`: lint, six rendered value sets against Kubernetes'
//! schemas, the wiring checks and their own planted faults, the image, smoke runs of the
//! rendered chart through kill -9 of an executor pod and of the leader) as one test of the
//! suite, on the binaries the suite tests. Run here rather than after the suite, the runner
//! schedules them beside the other tests: the smoke runs mostly wait (on leases, restarts and
//! streams), which on two cores left one idle for most of two minutes.

use std::process::Command;

#[test]
fn the_chart_lints_validates_wires_builds_its_image_and_survives_its_smoke_runs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin = ferry_tests::bin_dir().unwrap();
    let status = Command::new(root.join("helm/tests/run"))
        .arg(&bin)
        .current_dir(&root)
        .status()
        .expect("running helm/tests/run");
    // Its output (above) names each check that failed and the time each took.
    assert!(status.success(), "helm/tests/run failed: {status}");
}
