//! The timeline trace: a rank's events as Chrome trace-event JSON.

use super::{Event, What, json_string};

/// The events of each rank (`(rank, events)`) as Chrome trace-event JSON
/// (opens in Perfetto or `chrome://tracing`): one track per rank, spans as
/// complete events (`"ph": "X"`, microseconds) nesting by time, categories
/// `step`, `module`, `op`, `collective`, `fsdp`; tensor memory as a counter
/// track per rank.
pub fn chrome_trace(ranks: &[(usize, Vec<Event>)]) -> String {
    let mut out = String::from("{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    let mut first = true;
    let mut push = |s: String| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
        out.push_str(&s);
    };
    for (rank, events) in ranks {
        push(format!(
            "{{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": 0, \"tid\": {rank}, \"args\": {{\"name\": \"rank {rank}\"}}}}"
        ));
        for e in events {
            let ts = e.start_ns as f64 / 1e3;
            let dur = e.dur_ns as f64 / 1e3;
            let (name, cat, args) = match &e.what {
                What::Step(s) => (format!("step {s}"), "step", String::new()),
                What::Module { fqn, phase } => (
                    format!("{} ({})", if fqn.is_empty() { "(root)" } else { fqn }, phase.name()),
                    "module",
                    String::new(),
                ),
                What::Op(op) => (op.to_string(), "op", String::new()),
                What::Collective {
                    kind,
                    group,
                    ranks,
                    bytes,
                    queued,
                } => (
                    format!("{} {}", kind.name(), group),
                    "collective",
                    format!(
                        "\"mesh_dims\": {}, \"ranks\": {ranks}, \"bytes\": {bytes}, \"queued\": {queued}",
                        json_string(group)
                    ),
                ),
                What::Region(r) => (r.to_string(), "fsdp", String::new()),
                What::OpLog(_) => continue,
                What::Memory(bytes) => {
                    push(format!(
                        "{{\"ph\": \"C\", \"name\": \"memory rank {rank}\", \"pid\": 0, \"tid\": {rank}, \"ts\": {ts:.3}, \"args\": {{\"bytes\": {bytes}}}}}"
                    ));
                    continue;
                }
            };
            let module = match &e.module {
                Some((m, p)) => format!("\"module\": {}, \"phase\": \"{}\"", json_string(m), p.name()),
                None => String::new(),
            };
            let args = [args, module]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(", ");
            push(format!(
                "{{\"ph\": \"X\", \"name\": {}, \"cat\": \"{cat}\", \"pid\": 0, \"tid\": {rank}, \"ts\": {ts:.3}, \"dur\": {dur:.3}, \"args\": {{{args}}}}}",
                json_string(&name)
            ));
        }
    }
    out.push_str("\n]}\n");
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::Phase;
    use super::*;

    #[test]
    fn the_trace_names_ranks_and_escapes_strings() {
        let events = vec![
            Event {
                what: What::Module {
                    fqn: Arc::from("a\"b"),
                    phase: Phase::Forward,
                },
                start_ns: 1000,
                dur_ns: 5000,
                module: None,
            },
            Event {
                what: What::Memory(64),
                start_ns: 2000,
                dur_ns: 0,
                module: None,
            },
        ];
        let json = chrome_trace(&[(3, events)]);
        assert!(json.contains("\"name\": \"rank 3\""), "{json}");
        assert!(json.contains("\"name\": \"a\\\"b (forward)\""), "{json}");
        assert!(json.contains("\"ts\": 1.000, \"dur\": 5.000"), "{json}");
        assert!(json.contains("\"ph\": \"C\", \"name\": \"memory rank 3\""), "{json}");
    }
}
