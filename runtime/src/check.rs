//! `--check-config`: a dry run that parses and checks every flag as the service would, prints
//! `<program>: configuration ok` and exits, without binding a port, reading a model or
//! reaching etcd. Deployment tooling runs each rendered container's command line through it
//! (the Helm chart's tests do), so a flag the binary would refuse fails before anything starts.

/// The dry-run flag every binary takes.
#[derive(Clone, Copy, Debug, Default, clap::Args)]
pub struct CheckArgs {
    /// Check the flags and exit (0 and `configuration ok`, or an error naming the flag):
    /// nothing is bound, loaded or contacted.
    #[arg(long = "check-config")]
    pub check_config: bool,
}

impl CheckArgs {
    /// Call once every flag is checked: with `--check-config`, prints `<program>:
    /// configuration ok` and returns true (the caller exits); otherwise returns false.
    pub fn dry_run_done(&self, program: &str) -> bool {
        if self.check_config {
            println!("{program}: configuration ok");
        }
        self.check_config
    }
}
