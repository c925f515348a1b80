//! `--auto --memory-budget SIZE`: every layout of the world's ranks planned on
//! meta tensors, ranked by estimated step time; the fastest whose planned peak
//! per rank fits the budget is the one to run.

use tessera::models::ActivationCheckpointing;
use tessera::plan::Machine;
use tessera::{BoxError, launch};

use crate::args::{Arch, Args};
use crate::plan_rank;
use crate::report::human;

/// One layout to plan: FSDP, HSDP, with or without TP (and with TP, the plain
/// or the sequence-parallel plan where the sequence splits evenly); resharding
/// after forward, not, or to each group size dividing the shard dim; f32 or
/// bf16 mixed precision; no block recomputed in backward, every block, or one
/// block in every `n` (each `n` from 2 below the number of blocks). The global
/// batch fixed.
fn candidates(args: &Args) -> Vec<Args> {
    let w = args.world;
    let global = args.global_batch();
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let heads_split = |t: usize| {
        let kv = if args.arch == Arch::Llama {
            args.llama().n_kv_heads
        } else {
            args.model.n_heads
        };
        args.model.n_heads.is_multiple_of(t) && kv.is_multiple_of(t)
    };
    let mut out = Vec::new();
    for t in divisors(w).filter(|&t| heads_split(t)) {
        let dp = w / t;
        if !global.is_multiple_of(dp) {
            continue;
        }
        for r in divisors(dp).filter(|&r| r == 1 || r < dp) {
            let mut mesh = if r == 1 { vec![dp] } else { vec![r, dp / r] };
            if t > 1 {
                mesh.push(t);
            }
            // Resharding: fully (None, false), not at all (None, true), or
            // to groups of k ranks of the shard dim.
            let shard = dp / r;
            let reshard = [(None, false), (None, true)].into_iter().chain(
                divisors(shard)
                    .filter(|&k| k > 1 && k < shard)
                    .map(|k| (Some(k), false)),
            );
            let sp_choices: &[bool] = if t > 1 && args.model.seq.is_multiple_of(t) {
                &[false, true]
            } else {
                &[false]
            };
            for (reshard_to, no_reshard) in reshard {
                for (&sequence_parallel, bf16) in sp_choices.iter().flat_map(|sp| [(sp, false), (sp, true)]) {
                    for ac in recompute_choices(args.model.n_layers) {
                        let mut a = args.clone();
                        a.mesh = mesh.clone();
                        a.tp = if t > 1 { t } else { 0 };
                        a.sequence_parallel = sequence_parallel;
                        a.batch = global / dp;
                        a.no_reshard = no_reshard;
                        a.reshard_to = reshard_to;
                        a.bf16 = bf16;
                        a.ac = ac;
                        out.push(a);
                    }
                }
            }
        }
    }
    out
}

/// Which blocks recompute their activations in backward: none, every block,
/// or one in every `n` for each `n` from 2 below `n_layers`.
fn recompute_choices(n_layers: usize) -> Vec<ActivationCheckpointing> {
    [ActivationCheckpointing::None, ActivationCheckpointing::Full]
        .into_iter()
        .chain((2..n_layers).map(ActivationCheckpointing::EveryNth))
        .collect()
}

/// The layout in words: `fsdp 4`, `hsdp 2x2 + tp 2, no reshard, bf16`.
pub(crate) fn label(a: &Args) -> String {
    let m = &a.mesh;
    let dp = if a.tp > 0 { &m[..m.len() - 1] } else { &m[..] };
    let mut s = match dp {
        [s] => format!("fsdp {s}"),
        [r, s] => format!("hsdp {r}x{s}"),
        other => format!("{other:?}"),
    };
    if a.tp > 0 {
        s += &format!(" + tp {}", a.tp);
        if a.sequence_parallel {
            s += " (sequence parallel)";
        }
    }
    if a.no_reshard {
        s += ", no reshard";
    }
    if let Some(k) = a.reshard_to {
        s += &format!(", reshard to {k}");
    }
    if a.bf16 {
        s += ", bf16";
    }
    match a.ac {
        ActivationCheckpointing::None => {}
        ActivationCheckpointing::Full => s += ", recompute",
        ActivationCheckpointing::EveryNth(n) => s += &format!(", recompute 1 in {n}"),
    }
    s
}

/// Plans every candidate layout (each on all the world's ranks, on meta
/// tensors), prints them ranked by estimated step time with their planned
/// peaks against the budget, and returns the fastest that fits.
///
/// # Errors
/// No layout fits the budget (the smallest planned peak is named), or
/// `--memory-budget` is missing.
pub(crate) fn choose(args: &Args, machine: Option<&Machine>, lead: bool) -> Result<Args, BoxError> {
    let machine = machine.ok_or("--auto estimates step times: it needs the machine's constants")?;
    let budget = args
        .memory_budget
        .ok_or("--auto needs --memory-budget SIZE (bytes, or with KiB, MiB, GiB)")?;
    let mut ranked = Vec::new();
    for a in candidates(args) {
        let planned = launch(a.world, {
            let (a, machine) = (a.clone(), machine.clone());
            move |ctx| plan_rank(ctx, &a, &machine)
        });
        match planned {
            Ok(plans) => {
                let (peak, step_s) = (plans[0].peak(), plans[0].step_time_s());
                ranked.push((a, Ok((peak, step_s))));
            }
            Err(e) => ranked.push((a, Err(e.to_string()))),
        }
    }
    ranked.sort_by(|x, y| match (&x.1, &y.1) {
        (Ok((_, a)), Ok((_, b))) => a.total_cmp(b),
        (Ok(_), Err(_)) => std::cmp::Ordering::Less,
        (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
        _ => std::cmp::Ordering::Equal,
    });
    let chosen = ranked
        .iter()
        .find(|(_, r)| matches!(r, Ok((peak, _)) if *peak <= budget))
        .map(|(a, _)| a.clone());
    if lead {
        println!(
            "layouts of {} ranks, fastest first (budget {} per rank):",
            args.world,
            human(budget)
        );
        for (a, r) in &ranked {
            let mark = if chosen.as_ref().is_some_and(|c| label(c) == label(a)) {
                "*"
            } else {
                " "
            };
            match r {
                Ok((peak, s)) => println!(
                    "{mark} {:<44} peak {:>10} per rank{}  step {:.4} s",
                    label(a),
                    human(*peak),
                    if *peak <= budget { "        " } else { " (over)" },
                    s
                ),
                Err(e) => println!("  {:<44} not plannable: {e}", label(a)),
            }
        }
    }
    chosen.ok_or_else(|| {
        let least = ranked.iter().filter_map(|(_, r)| r.as_ref().ok().map(|p| p.0)).min();
        format!(
            "no layout of {} ranks fits --memory-budget {} per rank (the smallest planned peak is {}); \
             raise the budget, add ranks or shrink the batch",
            args.world,
            human(budget),
            least.map_or("unknown".into(), human)
        )
        .into()
    })
}
