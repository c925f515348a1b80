//! Names the first DTensor op whose global output differs between two op logs
//! (say one rank and FSDP+TP on 2 × 2), from the sums `train --op-log PATH
//! --op-log-values` records for every op.
//!
//! ```text
//! cargo run --release --example op_log_diff -- A.json B.json [--rtol 1e-4]
//! ```
//!
//! The logs' ops are matched in order, leaving out explicit redistributes
//! (layouts differ between meshes; values do not): the first pair whose op or
//! global shape differs means the programs diverge there; the first pair
//! whose sum, sum of absolute values or sum of squares differ by more than
//! `rtol` (relative to the larger magnitude, with the sum of absolute values
//! as the sum's scale) is named with its module. Exit status 0 when no op
//! differs, 1 when one does, 2 for bad input.

use std::process::ExitCode;

use serde_json::Value;

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("op_log_diff: {e}");
            ExitCode::from(2)
        }
    }
}

fn load(path: &str) -> Result<Vec<Value>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| format!("{path} is not an op log (JSON): {e}"))?;
    let ops = v["ops"]
        .as_array()
        .ok_or_else(|| format!("{path} has no \"ops\" list; write it with train --op-log PATH"))?;
    Ok(ops
        .iter()
        .filter(|o| o["explicit"] != Value::Bool(true))
        .cloned()
        .collect())
}

fn run() -> Result<bool, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut rtol = 1e-4;
    let mut paths = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--rtol" {
            let v = it.next().ok_or("--rtol needs a value")?;
            rtol = v.parse().map_err(|_| format!("--rtol: {v:?} is not a number"))?;
        } else {
            paths.push(a.clone());
        }
    }
    let [a, b] = &paths[..] else {
        return Err("usage: op_log_diff A.json B.json [--rtol R]".into());
    };
    let (xs, ys) = (load(a)?, load(b)?);
    let name = |o: &Value| {
        format!(
            "{} in {} -> {} {}",
            o["op"].as_str().unwrap_or("?"),
            o["module"].as_str().unwrap_or("(no module)"),
            o["output"]["dtype"].as_str().unwrap_or("?"),
            o["output"]["shape"]
        )
    };
    for (i, (x, y)) in xs.iter().zip(&ys).enumerate() {
        if x["op"] != y["op"] || x["output"]["shape"] != y["output"]["shape"] {
            println!(
                "the programs diverge at op {i}: {a} runs {} and {b} runs {}",
                name(x),
                name(y)
            );
            return Ok(false);
        }
        let (Some(vx), Some(vy)) = (x["values"].as_array(), y["values"].as_array()) else {
            return Err(format!(
                "op {i} ({}) has no values; record with --op-log-values",
                name(x)
            ));
        };
        let get = |v: &Vec<Value>, k: usize| v[k].as_f64().unwrap_or(f64::NAN);
        let scale = get(vx, 1).abs().max(get(vy, 1).abs()).max(f64::MIN_POSITIVE);
        for (k, what) in ["sum", "sum of |x|", "sum of x²"].iter().enumerate() {
            let (p, q) = (get(vx, k), get(vy, k));
            let s = if k == 0 {
                scale
            } else {
                p.abs().max(q.abs()).max(f64::MIN_POSITIVE)
            };
            let rel = (p - q).abs() / s;
            // NaN (a value missing on one side) counts as a difference.
            if rel.is_nan() || rel > rtol {
                println!(
                    "first difference at op {i}: {}: {what} {p:.9e} in {a}, {q:.9e} in {b} (relative {rel:.2e} > {rtol:e})",
                    name(x)
                );
                return Ok(false);
            }
        }
    }
    if xs.len() != ys.len() {
        println!(
            "the logs agree on their first {} ops, then one ends ({} vs {} ops)",
            xs.len().min(ys.len()),
            xs.len(),
            ys.len()
        );
        return Ok(false);
    }
    println!("{} ops agree within {rtol:e}", xs.len());
    Ok(true)
}
