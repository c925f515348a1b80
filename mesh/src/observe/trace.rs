//! The timeline trace: a rank's events as Chrome trace-event JSON.

use super::{Event, What, json_string};

/// The thread id of rank 0's communication track (rank r's is this + r).
pub const COMM_TRACK: usize = 1_000_000;

/// The events of each rank (`(rank, events)`) as Chrome trace-event JSON
/// (opens in Perfetto or `chrome://tracing`): one track per rank, spans as
/// complete events (`"ph": "X"`, microseconds) nesting by time, categories
/// `step`, `module`, `op`, `collective`, `fsdp`; tensor memory as a counter
/// track per rank; and a second track per rank ("rank r communication", thread
/// id [`COMM_TRACK`] + r) with its asynchronous collectives' runs on the
/// communication thread (category `communication`), where a run drawn beside
/// the rank's own spans shows what it overlapped.
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
        if events.iter().any(|e| matches!(e.what, What::CommRun { .. })) {
            push(format!(
                "{{\"ph\": \"M\", \"name\": \"thread_name\", \"pid\": 0, \"tid\": {}, \"args\": {{\"name\": \"rank {rank} communication\"}}}}",
                COMM_TRACK + rank
            ));
        }
        for e in events {
            if let Some(json) = event_json(*rank, e) {
                push(json);
            }
        }
    }
    out.push_str("\n]}\n");
    out
}

/// One event of `rank` as a trace event: a span, a memory counter, or none (an op log).
fn event_json(rank: usize, e: &Event) -> Option<String> {
    let mut tid = rank;
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
        What::CommRun {
            kind,
            group,
            bytes,
            blocked_ns,
        } => {
            tid = COMM_TRACK + rank;
            (
                format!("{} {}", kind.name(), group),
                "communication",
                format!(
                    "\"mesh_dims\": {}, \"bytes\": {bytes}, \"blocked_us\": {:.3}",
                    json_string(group),
                    *blocked_ns as f64 / 1e3
                ),
            )
        }
        What::OpLog(_) => return None,
        What::Memory(bytes) => {
            let ts = e.start_ns as f64 / 1e3;
            return Some(format!(
                "{{\"ph\": \"C\", \"name\": \"memory rank {rank}\", \"pid\": 0, \"tid\": {rank}, \"ts\": {ts:.3}, \"args\": {{\"bytes\": {bytes}}}}}"
            ));
        }
    };
    Some(complete_event(e, &name, cat, tid, args))
}

/// `e` as a complete event (`"ph": "X"`) on track `tid`, its `args` then its module's.
fn complete_event(e: &Event, name: &str, cat: &str, tid: usize, args: String) -> String {
    let ts = e.start_ns as f64 / 1e3;
    let dur = e.dur_ns as f64 / 1e3;
    let module = match &e.module {
        Some((m, p)) => format!("\"module\": {}, \"phase\": \"{}\"", json_string(m), p.name()),
        None => String::new(),
    };
    let args = [args, module]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "{{\"ph\": \"X\", \"name\": {}, \"cat\": \"{cat}\", \"pid\": 0, \"tid\": {tid}, \"ts\": {ts:.3}, \"dur\": {dur:.3}, \"args\": {{{args}}}}}",
        json_string(name)
    )
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
        let json = chrome_trace(&[(3, events.clone())]);
        assert!(
            !json.contains("communication"),
            "no runs, no communication track: {json}"
        );
        assert!(json.contains("\"name\": \"rank 3\""), "{json}");
        assert!(json.contains("\"name\": \"a\\\"b (forward)\""), "{json}");
        assert!(json.contains("\"ts\": 1.000, \"dur\": 5.000"), "{json}");
        assert!(json.contains("\"ph\": \"C\", \"name\": \"memory rank 3\""), "{json}");
    }

    #[test]
    fn collective_runs_go_on_the_ranks_communication_track() {
        let run = Event {
            what: What::CommRun {
                kind: crate::OpKind::AllGather,
                group: Arc::from("dp"),
                bytes: 4096,
                blocked_ns: 1500,
            },
            start_ns: 4000,
            dur_ns: 2000,
            module: None,
        };
        let json = chrome_trace(&[(2, vec![run])]);
        assert!(
            json.contains("\"tid\": 1000002, \"args\": {\"name\": \"rank 2 communication\"}"),
            "{json}"
        );
        assert!(
            json.contains(
                "\"name\": \"all_gather dp\", \"cat\": \"communication\", \"pid\": 0, \"tid\": 1000002, \"ts\": 4.000, \"dur\": 2.000"
            ),
            "{json}"
        );
        assert!(json.contains("\"bytes\": 4096, \"blocked_us\": 1.500"), "{json}");
    }
}
