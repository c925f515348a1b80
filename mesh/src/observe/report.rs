//! The collective report (PyTorch: `CommDebugMode`): a rank's collectives by
//! module, phase, mesh dims and kind.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

use super::{Event, Phase, What};
use crate::stats::OpKind;

/// Collectives by module, phase, mesh dims and kind: calls and bytes sent by
/// this rank. PyTorch: `CommDebugMode.get_comm_counts` per module
/// (`generate_comm_debug_tracing_table`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommReport {
    /// `(module, phase, mesh dims, kind) -> (calls, bytes)`; collectives
    /// issued outside any module have module `"(none)"` and phase forward.
    pub rows: BTreeMap<(String, Phase, String, OpKind), (u64, u64)>,
}

impl CommReport {
    /// The collectives among `events` (barriers left out).
    pub fn from_events(events: &[Event]) -> CommReport {
        let mut rows: BTreeMap<(String, Phase, String, OpKind), (u64, u64)> = BTreeMap::new();
        for e in events {
            if let What::Collective { kind, group, bytes, .. } = &e.what {
                if *kind == OpKind::Barrier {
                    continue;
                }
                let (module, phase) = match &e.module {
                    Some((m, p)) => (if m.is_empty() { "(root)".into() } else { m.to_string() }, *p),
                    None => ("(none)".to_string(), Phase::Forward),
                };
                let row = rows.entry((module, phase, group.to_string(), *kind)).or_default();
                row.0 += 1;
                row.1 += bytes;
            }
        }
        CommReport { rows }
    }

    /// Calls and bytes of `kind` over every row.
    pub fn total(&self, kind: OpKind) -> (u64, u64) {
        self.rows
            .iter()
            .filter(|((_, _, _, k), _)| *k == kind)
            .fold((0, 0), |(c, b), (_, &(rc, rb))| (c + rc, b + rb))
    }

    /// Calls and bytes by mesh dims and kind, summed over modules and phases.
    pub fn by_dims(&self) -> BTreeMap<(String, OpKind), (u64, u64)> {
        let mut out: BTreeMap<(String, OpKind), (u64, u64)> = BTreeMap::new();
        for ((_, _, dims, kind), &(calls, bytes)) in &self.rows {
            let row = out.entry((dims.clone(), *kind)).or_default();
            row.0 += calls;
            row.1 += bytes;
        }
        out
    }

    /// The report as JSON: `{"rows": [{"module", "phase", "mesh_dims",
    /// "collective", "calls", "bytes"}, ...]}`.
    pub fn to_json(&self) -> String {
        let mut out = String::from("{\"rows\": [");
        for (i, ((module, phase, group, kind), (calls, bytes))) in self.rows.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(
                out,
                "{{\"module\": {}, \"phase\": \"{}\", \"mesh_dims\": {}, \"collective\": \"{}\", \"calls\": {calls}, \"bytes\": {bytes}}}",
                json_string(module),
                phase.name(),
                json_string(group),
                kind.name()
            );
        }
        out.push_str("]}");
        out
    }
}

impl fmt::Display for CommReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self.rows.keys().map(|(m, ..)| m.len()).max().unwrap_or(6).max(6);
        writeln!(
            f,
            "{:<width$}  {:<8}  {:<10}  {:<14}  {:>6}  {:>12}",
            "module", "phase", "mesh dims", "collective", "calls", "bytes"
        )?;
        for ((module, phase, group, kind), (calls, bytes)) in &self.rows {
            writeln!(
                f,
                "{module:<width$}  {:<8}  {group:<10}  {:<14}  {calls:>6}  {bytes:>12}",
                phase.name(),
                kind.name()
            )?;
        }
        Ok(())
    }
}

/// `s` as a JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::super::{collective, current_module, module, name_group, record, span};
    use super::*;

    #[test]
    fn nothing_is_recorded_off_and_groups_take_their_names() {
        {
            let _op = span(What::Op("add"));
            let _m = module("x", Phase::Forward);
        }
        assert_eq!(current_module(), None);
        name_group(7, "tp");
        let rec = record();
        {
            let _m = module("layers.1.ffn", Phase::Backward);
            drop(collective(7, OpKind::AllReduce, 4, 300, false));
            drop(collective(8, OpKind::AllGather, 2, 50, true));
            drop(collective(7, OpKind::Barrier, 4, 0, false));
        }
        let report = CommReport::from_events(&rec.finish());
        assert_eq!(
            report
                .rows
                .get(&("layers.1.ffn".into(), Phase::Backward, "tp".into(), OpKind::AllReduce)),
            Some(&(1, 300))
        );
        assert_eq!(
            report.rows.get(&(
                "layers.1.ffn".into(),
                Phase::Backward,
                "comm(2)".into(),
                OpKind::AllGather
            )),
            Some(&(1, 50))
        );
        assert_eq!(report.rows.len(), 2, "barriers are left out: {report}");
        assert_eq!(report.total(OpKind::AllReduce), (1, 300));
        let json = report.to_json();
        assert!(
            json.contains("\"module\": \"layers.1.ffn\", \"phase\": \"backward\", \"mesh_dims\": \"tp\""),
            "{json}"
        );
        assert!(report.to_string().contains("all_reduce"));
    }
}
