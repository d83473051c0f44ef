//! A workload read from a JSONL trace: one request per line, in arrival order, with its
//! lengths and optionally a shared prefix; a bad line is refused with its number.

use std::fs::File;
use std::io::{BufReader, Lines};

use super::tokens::prompt_tokens;
use super::SimRequest;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TraceLine {
    arrival: f64,
    prompt_len: u32,
    output_len: u32,
    #[serde(default)]
    prefix_group: Option<u32>,
    #[serde(default)]
    prefix_len: u32,
}

/// The next request of the trace at `path` (`made` requests and `line` lines read so far, the
/// last arriving at `clock`; all advanced), `None` after the last; an error for a bad line.
pub(super) fn next_request(
    lines: &mut Lines<BufReader<File>>,
    path: &str,
    made: &mut u64,
    line: &mut u64,
    vocab_size: u32,
    clock: &mut f64,
) -> Result<Option<SimRequest>, String> {
    loop {
        let Some(text) = lines.next() else { return Ok(None) };
        *line += 1;
        let text = text.map_err(|e| format!("trace {path}: {e}"))?;
        if text.trim().is_empty() {
            continue;
        }
        let t: TraceLine =
            serde_json::from_str(&text).map_err(|e| format!("trace {path}:{line}: {e}"))?;
        if !t.arrival.is_finite() || t.arrival < *clock {
            return Err(format!(
                "trace {path}:{line}: arrival {} is before the previous line's {}",
                t.arrival, clock
            ));
        }
        if t.prompt_len == 0 || t.output_len == 0 {
            return Err(format!("trace {path}:{line}: lengths must be at least 1"));
        }
        *clock = t.arrival;
        let index = *made;
        *made += 1;
        let prompt = prompt_tokens(index, t.prompt_len, t.prefix_group, t.prefix_len, vocab_size);
        return Ok(Some(SimRequest {
            index,
            arrival: t.arrival,
            prompt,
            output_len: t.output_len,
            group: t.prefix_group,
            conversation: None,
            follow_ups: Vec::new(),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Source;

    #[test]
    fn a_trace_gives_its_requests_in_order_and_a_bad_line_is_refused_by_number() {
        let path =
            std::env::temp_dir().join(format!("ferry-sim-trace-{}.jsonl", std::process::id()));
        let lines = [
            r#"{"arrival": 0.5, "prompt_len": 40, "output_len": 3, "prefix_group": 7, "prefix_len": 32}"#,
            "",
            r#"{"arrival": 0.5, "prompt_len": 50, "output_len": 4, "prefix_group": 7, "prefix_len": 32}"#,
            r#"{"arrival": 2.0, "prompt_len": 10, "output_len": 1}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let mut source = Source::trace(path.to_str().unwrap(), 1000).unwrap();
        let all: Vec<SimRequest> = std::iter::from_fn(|| source.next_request().unwrap()).collect();
        assert_eq!(all.len(), 3);
        assert_eq!(all.iter().map(|r| r.arrival).collect::<Vec<_>>(), [0.5, 0.5, 2.0]);
        assert_eq!(all.iter().map(|r| r.prompt.len()).collect::<Vec<_>>(), [40, 50, 10]);
        assert_eq!(all[1].output_len, 4);
        assert_eq!(all[0].prompt[..32], all[1].prompt[..32], "one prefix group");
        assert_ne!(all[0].prompt[32..40], all[1].prompt[32..40]);
        for (bad, want) in [
            (r#"{"arrival": 0.1, "prompt_len": 5, "output_len": 1}"#, ":2: arrival 0.1 is before"),
            (r#"{"arrival": 3.0, "prompt_len": 0, "output_len": 1}"#, ":2: lengths must be"),
            (r#"{"arrival": 3.0, "prompt": 5}"#, "trace"),
        ] {
            std::fs::write(&path, format!("{}\n{bad}\n", lines[0])).unwrap();
            let mut source = Source::trace(path.to_str().unwrap(), 1000).unwrap();
            source.next_request().unwrap();
            let err = source.next_request().unwrap_err();
            assert!(err.contains(want), "{err}");
        }
        let _ = std::fs::remove_file(path);
    }
}
