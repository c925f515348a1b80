//! The main job as a user meets it: Tessera variables with values they do not
//! accept stop the job naming what they accept, `train --help` lists every flag
//! with its default, a redirected log gets progress lines, not `\r` frames, and
//! checkpoints kept and saves killed mid-write leave no temporaries behind;
//! `--model llama` trains the LLaMA reference as PyTorch does; the user-model
//! example resumes on another mesh; `bench_redistribute --case` times the rows
//! asked for.
//! (Runs the `train` example, which `cargo test` builds.)

use std::path::PathBuf;
use std::process::{Command, Output};

/// The example `name` beside this test binary.
fn example_exe(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps/<test>");
    let path: PathBuf = profile_dir.join("examples").join(name);
    assert!(path.exists(), "{} is missing: `cargo test` builds it", path.display());
    path
}

/// The `train` example beside this test binary.
fn train_exe() -> PathBuf {
    example_exe("train")
}

fn train(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(train_exe());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn bad_variables_stop_the_job_naming_what_they_accept() {
    for (k, v, says) in [
        ("TESSERA_BACKEND", "bogus", "accepted: threads, mpi"),
        ("TESSERA_BF16_DOT", "maybe", "not a flag"),
        ("TESSERA_SYSTEM_MALLOC", "2", "not a flag"),
        ("TESSERA_TIMEOUT_S", "forever", "TESSERA_TIMEOUT_S"),
        ("TESSERA_DEBUG", "all", "accepted: off, ops, values"),
    ] {
        let out = train(&["--world-size", "1", "--steps", "1"], &[(k, v)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{k}={v} was accepted");
        assert!(
            err.contains(&format!("{k}=\"{v}\"")) && err.contains(says),
            "{k}={v}: {err}"
        );
    }
}

#[test]
fn false_is_a_flag_value_and_a_redirected_log_gets_lines() {
    let out = train(&["--world-size", "1", "--steps", "3"], &[("TESSERA_BF16_DOT", "false")]);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!log.contains('\r'), "a redirected log holds no \\r frames: {log:?}");
    for step in 1..=3 {
        assert!(log.contains(&format!("step {step}/3  loss")), "{log}");
    }
}

/// `TESSERA_DEBUG=ops` makes every rank print each DTensor op as it runs,
/// under its module, in the layout notation, with the TP plan's explicit
/// redistributes; `values` adds the outputs' global sums; unset, nothing.
#[test]
fn tessera_debug_prints_every_rank_s_ops() {
    let args = ["--world-size", "4", "--tp", "2", "--steps", "1"];
    let ops = train(&args, &[("TESSERA_DEBUG", "ops")]);
    let err = String::from_utf8_lossy(&ops.stderr);
    assert!(ops.status.success(), "{err}");
    for rank in 0..4 {
        let lines = err
            .lines()
            .filter(|l| l.starts_with(&format!("[rank {rank}] ")))
            .count();
        assert!(lines > 100, "rank {rank} printed {lines} ops:\n{err}");
    }
    let wo = err
        .lines()
        .find(|l| l.starts_with("[rank 0] layers.0.attention.wo forward: ") && l.contains("explicit redistribute"))
        .unwrap_or_else(|| panic!("no explicit redistribute in layers.0.attention.wo:\n{err}"));
    assert!(
        wo.contains("(Shard(0), Partial(sum))") && wo.contains("on mesh(dp=2, tp=2)"),
        "{wo}"
    );
    assert!(
        !err.contains("implicit redistribute"),
        "the TP plan redistributes nothing implicitly"
    );
    assert!(!err.contains("; sum "), "values only when asked");
    // Only the program's step is echoed: not the machine's calibration nor
    // the planned step on meta tensors that train runs first (one forward:
    // the token and position embeddings once each).
    let embeddings = err
        .lines()
        .filter(|l| l.starts_with("[rank 0] ") && l.contains("embedding("))
        .count();
    assert_eq!(embeddings, 2, "{err}");

    let values = train(&["--world-size", "2", "--steps", "1"], &[("TESSERA_DEBUG", "values")]);
    let err = String::from_utf8_lossy(&values.stderr);
    assert!(values.status.success(), "{err}");
    assert!(
        err.lines().any(|l| l.starts_with("[rank 1] ") && l.contains("; sum ")),
        "{err}"
    );

    let quiet = train(&["--world-size", "2", "--steps", "1"], &[]);
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("[rank 0]"));
}

/// `--save-hf` writes the LLaMA model as Hugging Face's `LlamaForCausalLM`
/// reads it: the weights under its names, equal to `--save-full`'s, and the
/// config with the model's sizes; with the GPT model it is an error.
#[test]
fn save_hf_writes_the_llama_model_for_hugging_face() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-hf-{}", std::process::id()));
    let full = std::env::temp_dir().join(format!("tessera-cli-hf-{}.safetensors", std::process::id()));
    let (d, f) = (dir.to_str().unwrap(), full.to_str().unwrap());
    let args = [
        "--model",
        "llama",
        "--n-kv-heads",
        "2",
        "--world-size",
        "2",
        "--steps",
        "1",
    ];
    let out = train(&[&args[..], &["--save-hf", d, "--save-full", f]].concat(), &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(
        (
            config["hidden_size"].as_u64(),
            config["num_attention_heads"].as_u64(),
            config["num_key_value_heads"].as_u64()
        ),
        (Some(64), Some(4), Some(2))
    );
    let hf_bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let full_bytes = std::fs::read(&full).unwrap();
    let (hf, ours) = (
        safetensors::SafeTensors::deserialize(&hf_bytes).unwrap(),
        safetensors::SafeTensors::deserialize(&full_bytes).unwrap(),
    );
    for (name, view) in ours.tensors() {
        let hf_name = tessera::models::hf_name(&name).unwrap();
        assert_eq!(hf.tensor(&hf_name).unwrap().data(), view.data(), "{name} as {hf_name}");
    }
    assert_eq!(hf.len(), ours.len());
    assert!(
        hf.names()
            .iter()
            .any(|n| *n == "model.layers.1.self_attn.k_proj.weight")
    );
    let _ = (std::fs::remove_dir_all(&dir), std::fs::remove_file(&full));

    let gpt = train(&["--world-size", "1", "--steps", "1", "--save-hf", d], &[]);
    assert!(!gpt.status.success());
    assert!(
        String::from_utf8_lossy(&gpt.stderr).contains("--save-hf"),
        "{}",
        String::from_utf8_lossy(&gpt.stderr)
    );
}

/// `--profile` prints where rank 0's steps went (per kind of work, then the
/// ops by time, the matrix products among them with their calls per step);
/// without it there is no table.
#[test]
fn profile_prints_the_ops_of_rank_0() {
    let args = ["--world-size", "2", "--steps", "4"];
    let out = train(&[&args[..], &["--profile"]].concat(), &[]);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("profile of rank 0 over 2 steps:"), "{log}");
    for kind in ["gemm", "communication", "optimizer", "other"] {
        assert!(
            log.lines().any(|l| l.trim_start().starts_with(kind)),
            "no {kind} line: {log}"
        );
    }
    // The tiny model's step: per layer 6 products forward, 12 backward
    // (attention's own products run inside the attention op), and the head's 3.
    let matmul = log
        .lines()
        .find(|l| l.trim_start().starts_with("matmul "))
        .unwrap_or_else(|| panic!("no matmul line: {log}"));
    assert!(matmul.contains(" 39 calls"), "{matmul}");
    let plain = train(&args, &[]);
    assert!(plain.status.success());
    assert!(!String::from_utf8_lossy(&plain.stdout).contains("profile of"));
}

#[test]
fn help_lists_every_flag_with_its_default() {
    let out = train(&["--help"], &[]);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--world-size",
        "--mesh",
        "--tp",
        "--sequence-parallel",
        "--mixed-precision",
        "--no-reshard",
        "--fsdp-units",
        "--dim",
        "--n-layers",
        "--n-heads",
        "--vocab",
        "--seq",
        "--model",
        "--n-kv-heads",
        "--ffn-hidden",
        "--rope-theta",
        "--init",
        "--seed",
        "--tokens",
        "--data-seed",
        "--steps",
        "--batch",
        "--lr",
        "--losses-out",
        "--metrics-out",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--async-save",
        "--keep-checkpoints",
        "--resume",
        "--resume-step",
        "--save-full",
        "--profile",
        "--comm-report",
        "--trace",
        "--plan",
        "--plan-out",
        "--auto",
        "--memory-budget",
        "--reshard-to",
        "--activation-checkpointing",
        "--device",
        "--lr-schedule",
        "--warmup-steps",
        "--save-hf",
        "--op-log",
        "--op-log-values",
        "--machine",
    ] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(flag) || l.contains(&format!(" {flag} ")))
            .unwrap_or_else(|| panic!("--help does not list {flag}:\n{help}"));
        assert!(!line.is_empty());
    }
    assert!(help.contains("default 50") && help.contains("default 0.001"), "{help}");
    // Every entry (a flag's line and its continuation lines) states its default.
    let mut entries: Vec<String> = Vec::new();
    for line in help.lines().take_while(|l| !l.starts_with("environment:")) {
        if line.trim_start().starts_with("--") && line.starts_with("  --") {
            entries.push(line.to_string());
        } else if line.starts_with("    ")
            && let Some(e) = entries.last_mut()
        {
            e.push_str(line);
        }
    }
    assert!(entries.len() >= 40, "{} entries:\n{help}", entries.len());
    for e in &entries {
        assert!(e.contains("default"), "no default stated: {e}");
    }
    let env = &help[help.find("environment:").expect("an environment section")..];
    for var in [
        "TESSERA_TIMEOUT_S",
        "TESSERA_THREADS_PER_RANK",
        "TESSERA_BACKEND",
        "TESSERA_BF16_DOT",
        "TESSERA_SYSTEM_MALLOC",
        "TESSERA_MPI_CHECK",
        "TESSERA_STRICT_COLLECTIVES",
        "TESSERA_FINGERPRINTS",
        "TESSERA_DEBUG",
    ] {
        assert!(env.contains(var), "{var} missing from:\n{env}");
    }
}

/// `--keep-checkpoints` counts complete checkpoints only: a damaged step
/// directory (no valid index.json) neither counts nor goes, and a killed
/// save's temporary (a dead process's, of another step) is removed by the next
/// save, whatever its name.
#[test]
fn kept_checkpoints_are_complete_ones_and_dead_temporaries_go() {
    let ck = std::env::temp_dir().join(format!("tessera-cli-keep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ck);
    std::fs::create_dir_all(ck.join("step_000003")).unwrap();
    std::fs::write(ck.join("step_000003").join("index.json"), b"{").unwrap();
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let tmp = ck.join(format!(".step_000014.tmp-{dead}-00112233445566778899aabbccddeeff"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(
        tmp.join("shard-00001-model-00001-of-00001.safetensors"),
        vec![0u8; 4096],
    )
    .unwrap();
    std::fs::write(tmp.join("writer.lock"), format!("pid {dead}")).unwrap();
    std::fs::write(ck.join(format!(".latest.tmp-{dead}-0")), b"step_").unwrap();
    let dir = ck.to_string_lossy().into_owned();
    let out = train(
        &[
            "--world-size",
            "2",
            "--steps",
            "4",
            "--checkpoint-dir",
            &dir,
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "2",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    let _ = std::fs::remove_dir_all(&ck);
    assert_eq!(left, ["latest", "step_000002", "step_000003", "step_000004"]);
}

/// Entries of `dir` whose names start with `.` (temporaries).
fn temporaries(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default()
}

/// Saves killed mid-write leak nothing: `train` saving step-numbered
/// checkpoints every step or two (in the background every other run) is
/// killed (SIGKILL) at seeded moments, each run resuming from the newest
/// checkpoint; the temporaries the kills leave are removed by the next run's
/// load or save, whatever their step. Then one run completes: nothing whose name
/// starts with `.` is left, and at most `--keep-checkpoints` step directories,
/// each complete. `TESSERA_KILLED_SAVES` runs more kills (default 12; the notes'
/// figure is from 60).
#[test]
fn killed_saves_leave_no_temporaries() {
    let kills: usize = match std::env::var("TESSERA_KILLED_SAVES") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("TESSERA_KILLED_SAVES={v:?}: give a whole number")),
        Err(_) => 12,
    };
    let ck = std::env::temp_dir().join(format!("tessera-cli-killed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&ck);
    let dir = ck.to_string_lossy().into_owned();
    let (mut left_by_kills, mut seen_after_next) = (0usize, 0usize);
    for i in 0..kills {
        let every = ["1", "2"][i % 2];
        let mut args = vec![
            "--world-size",
            "2",
            "--steps",
            "100000",
            "--checkpoint-dir",
            &dir,
            "--checkpoint-every",
            every,
            "--keep-checkpoints",
            "2",
        ];
        if i % 2 == 1 {
            args.push("--async-save");
        }
        if ck.join("latest").exists() {
            args.extend(["--resume", &dir]);
        }
        let mut child = Command::new(train_exe())
            .args(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(150 + (i as u64 * 97) % 450));
        child.kill().unwrap();
        child.wait().unwrap();
        let left = temporaries(&ck);
        left_by_kills += usize::from(!left.is_empty());
        seen_after_next = seen_after_next.max(left.len());
    }
    // One run that completes: it loads the newest checkpoint and saves twice.
    let latest = std::fs::read_to_string(ck.join("latest")).expect("the kills left a newest checkpoint");
    let step: usize = latest.trim().trim_start_matches("step_").parse().unwrap();
    let steps = (step + 2).to_string();
    let out = train(
        &[
            "--world-size",
            "2",
            "--steps",
            &steps,
            "--checkpoint-dir",
            &dir,
            "--checkpoint-every",
            "1",
            "--keep-checkpoints",
            "2",
            "--resume",
            &dir,
        ],
        &[],
    );
    let left = temporaries(&ck);
    let steps_kept: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step_"))
        .collect();
    let broken: Vec<String> = steps_kept
        .iter()
        .filter_map(|s| {
            tessera::dtensor::checkpoint::Checkpoint::open(ck.join(s))
                .err()
                .map(|e| format!("{s}: {e}"))
        })
        .collect();
    let _ = std::fs::remove_dir_all(&ck);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    println!(
        "killed saves: {kills} runs killed, {left_by_kills} left temporaries behind (at most {seen_after_next} at once); \
         after the next complete run: {} temporaries, {} step directories kept",
        left.len(),
        steps_kept.len()
    );
    assert!(left.is_empty(), "temporaries leaked: {left:?}");
    assert!(broken.is_empty(), "incomplete checkpoints left: {broken:?}");
    assert!(steps_kept.len() <= 2, "kept {steps_kept:?}");
    assert!(
        kills < 8 || left_by_kills > 0,
        "no kill landed in a save: the test exercises nothing"
    );
}

/// A JSON file `train` wrote.
fn read_json(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The list of integers under `key` (`peak_bytes_per_rank`, ...).
fn u64_column(v: &serde_json::Value, key: &str) -> Vec<u64> {
    v[key].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

/// `loss` of a `--losses-out` file.
fn losses(path: &std::path::Path) -> Vec<f64> {
    read_json(path)["loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

/// `--lr-schedule` changes the run (warmup starts lower than the constant
/// rate), and a run stopped and resumed from its checkpoint continues the
/// schedule exactly: its losses equal the uninterrupted run's, bit for bit.
#[test]
fn a_learning_rate_schedule_changes_the_run_and_resumes_exactly() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-sched-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let run = |extra: &[&str], out: &str| {
        let mut args = vec!["--world-size", "2", "--steps", "8", "--lr", "0.01"];
        args.extend_from_slice(extra);
        let out_path = path(out);
        args.extend(["--losses-out", &out_path]);
        let o = train(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        losses(&dir.join(out))
    };
    let sched = ["--lr-schedule", "cosine", "--warmup-steps", "3"];
    let constant = run(&[], "constant.json");
    let whole = run(&sched, "whole.json");
    assert_eq!(constant[0], whole[0], "step 1's loss comes before any update");
    assert_ne!(constant[1..], whole[1..], "the schedule changed nothing");
    // Stopped after step 4 (the checkpoint), then resumed to step 8.
    let ck = path("ck");
    let first = run(
        &[
            &sched[..],
            &["--checkpoint-dir", &ck, "--checkpoint-every", "4", "--steps", "4"],
        ]
        .concat(),
        "first.json",
    );
    let rest = run(&[&sched[..], &["--resume", &ck]].concat(), "rest.json");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(first, whole[..4]);
    assert_eq!(rest, whole[4..], "the resumed run left the schedule");
}

/// `train --model llama` from the reference's initial weights and tokens
/// matches PyTorch's FSDP×TP run at every step, and LLaMA's flags are checked.
#[test]
fn train_model_llama_matches_pytorch_and_checks_its_flags() {
    let data = |f: &str| format!("{}/tests/data/{f}", env!("CARGO_MANIFEST_DIR"));
    let out_path = std::env::temp_dir().join(format!("tessera-cli-llama-{}.json", std::process::id()));
    let (init, tokens, out) = (
        data("llama_tiny_init.safetensors"),
        data("tiny_tokens_G16.safetensors"),
        out_path.to_string_lossy().into_owned(),
    );
    let o = train(
        &[
            "--model",
            "llama",
            "--n-kv-heads",
            "2",
            "--ffn-hidden",
            "192",
            "--world-size",
            "4",
            "--tp",
            "2",
            "--batch",
            "4",
            "--steps",
            "20",
            "--init",
            &init,
            "--tokens",
            &tokens,
            "--losses-out",
            &out,
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = String::from_utf8_lossy(&o.stdout);
    assert!(
        log.contains("2-layer LLaMA (dim 64, 4 heads / 2 kv heads, ffn 192"),
        "{log}"
    );
    let got = losses(&out_path);
    let _ = std::fs::remove_file(&out_path);
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data("llama_reference.json")).unwrap()).unwrap();
    let want: Vec<f64> = reference["runs"]["fsdp_tp_2x2_G8"]["loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len());
    for (s, (a, b)) in got.iter().zip(&want).enumerate() {
        assert!((a - b).abs() < 1e-5, "step {s}: {a} vs PyTorch {b}");
    }
    for (args, says) in [
        (&["--n-kv-heads", "2"][..], "are for --model llama"),
        (
            &["--model", "llama", "--n-kv-heads", "3"],
            "n_kv_heads 3 must divide n_heads 4",
        ),
        (
            &["--model", "llama", "--rope-theta", "-1"],
            "rope_theta -1 must be finite and positive",
        ),
        (&["--model", "mamba"], "--model: \"mamba\" (gpt or llama)"),
    ] {
        let o = train(args, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(says), "{args:?}: {err}");
    }
}

/// The user-model example: a LLaMA-style model written on the public API with
/// its own plan trains on FSDP×TP, checkpoints, and resumes on FSDP alone,
/// going on as the uninterrupted run does (the example checks it and fails
/// otherwise).
#[test]
fn the_user_model_example_resumes_on_another_mesh() {
    let out = Command::new(example_exe("custom_llama")).output().unwrap();
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{log}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(log.contains("resumed after step 6 with FSDP on 2 ranks"), "{log}");
    assert!(log.contains("max |Δloss| of the resumed steps"), "{log}");
}

/// `--metrics-out` writes one JSON line per step: its loss (the `--losses-out`
/// loss), the learning rate the update used, the gradients' global norm (the
/// same on one rank and on two for the same global batch), step time, tokens/s,
/// utilisation, and every rank's bytes; measuring changes nothing in training.
#[test]
fn metrics_out_writes_a_line_per_step_that_agrees_across_meshes() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-metrics-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let run = |world: &str, batch: &str, metrics: Option<&str>, out: &str| {
        let out_path = path(out);
        let mut args = vec![
            "--world-size",
            world,
            "--batch",
            batch,
            "--steps",
            "3",
            "--lr-schedule",
            "cosine",
            "--warmup-steps",
            "2",
            "--losses-out",
            &out_path,
        ];
        let m = metrics.map(path);
        if let Some(m) = &m {
            args.extend(["--metrics-out", m.as_str()]);
        }
        let o = train(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let log = String::from_utf8_lossy(&o.stdout);
        // The summary's utilisation, where the FMA peak can be measured.
        assert!(!fma_measurable() || log.contains("model FLOPs utilisation"), "{log}");
        losses(&dir.join(out))
    };
    let read = |name: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.join(name))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let one = run("1", "4", Some("one.jsonl"), "one.json");
    let two = run("2", "2", Some("two.jsonl"), "two.json");
    let plain = run("2", "2", None, "plain.json");
    assert_eq!(two, plain, "measuring the gradient norm changed training");
    assert!(!dir.join("plain.jsonl").exists());
    let (m1, m2) = (read("one.jsonl"), read("two.jsonl"));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!((m1.len(), m2.len()), (3, 3));
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    for (i, (a, b)) in m1.iter().zip(&m2).enumerate() {
        assert_eq!(a["step"], i + 1);
        assert_eq!(
            (f(a, "loss"), f(b, "loss")),
            (one[i], two[i]),
            "the loss is the --losses-out loss"
        );
        let (ga, gb) = (f(a, "grad_norm"), f(b, "grad_norm"));
        assert!(
            ga > 0.0 && (ga - gb).abs() <= 1e-6 * ga,
            "step {i}: grad norm {ga} on one rank, {gb} on two"
        );
        assert_eq!(f(a, "lr"), f(b, "lr"));
        assert!(f(b, "step_time_s") > 0.0 && f(b, "tokens_per_s") > 0.0);
        if let Some(mfu) = b["mfu"].as_f64() {
            assert!(mfu > 0.0 && mfu <= 1.0, "{mfu}");
        }
        let (used, peak) = (
            b["bytes_in_use_per_rank"].as_array().unwrap(),
            b["peak_bytes_per_rank"].as_array().unwrap(),
        );
        assert_eq!((used.len(), peak.len()), (2, 2));
        assert!(
            used.iter()
                .zip(peak)
                .all(|(u, p)| u.as_u64() <= p.as_u64() && p.as_u64() > Some(0))
        );
    }
    // Linear warmup over 2 steps, then cosine decay.
    let lr: Vec<f64> = m1.iter().map(|v| f(v, "lr")).collect();
    assert!(lr[0] < lr[1] && lr[1] < lr[2], "{lr:?}");
}

/// Whether `train` can measure this CPU's FMA peak (x86-64 with AVX2 and FMA).
fn fma_measurable() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `train` on FSDP over TP (2 × 2) for `steps` steps writing the JSON file
/// that `flag` names: the output, and the file's contents (read, then removed).
fn fsdp_tp_json(flag: &str, steps: usize) -> (Output, serde_json::Value) {
    let name = flag.trim_start_matches('-');
    let path = std::env::temp_dir().join(format!("tessera-cli-{name}-{}.json", std::process::id()));
    let steps = steps.to_string();
    let args = [
        "--world-size",
        "4",
        "--tp",
        "2",
        "--steps",
        &steps,
        flag,
        path.to_str().unwrap(),
    ];
    let out = train(&args, &[]);
    assert!(out.status.success(), "{flag}: {}", String::from_utf8_lossy(&out.stderr));
    let v = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    (out, v)
}

/// `--comm-report` on FSDP over TP (2 × 2): the report's totals per kind are
/// the rank's collective counters over the same steps, and the rows put each
/// collective where it belongs: FSDP's gathers over dp in a block's forward and
/// its reduce-scatters in backward, the row-parallel outputs' all-reduces over
/// tp in the forward of `wo` and `w2`.
#[test]
fn comm_report_attributes_every_collective_and_sums_to_the_counters() {
    let (out, v) = fsdp_tp_json("--comm-report", 2);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(log.contains("collectives of rank 0 over 2 steps:"), "{log}");
    let rows = v["report"]["rows"].as_array().unwrap();
    for kind in ["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast"] {
        let (calls, bytes) = rows
            .iter()
            .filter(|r| r["collective"] == kind)
            .fold((0, 0), |(c, b), r| {
                (c + r["calls"].as_u64().unwrap(), b + r["bytes"].as_u64().unwrap())
            });
        assert_eq!(
            calls,
            v["counters"][kind]["calls"].as_u64().unwrap(),
            "{kind} calls: {v}"
        );
        assert_eq!(
            bytes,
            v["counters"][kind]["bytes"].as_u64().unwrap(),
            "{kind} bytes: {v}"
        );
    }
    let row = |module: &str, phase: &str, dims: &str, kind: &str| {
        rows.iter()
            .find(|r| r["module"] == module && r["phase"] == phase && r["mesh_dims"] == dims && r["collective"] == kind)
            .map(|r| r["calls"].as_u64().unwrap())
    };
    assert_eq!(row("layers.0", "forward", "dp", "all_gather"), Some(2), "{v}");
    assert!(row("layers.0", "backward", "dp", "reduce_scatter").is_some(), "{v}");
    assert_eq!(
        row("layers.1.attention.wo", "forward", "tp", "all_reduce"),
        Some(2),
        "{v}"
    );
    assert_eq!(
        row("layers.1.feed_forward.w2", "forward", "tp", "all_reduce"),
        Some(2),
        "{v}"
    );
}

/// `--trace` writes Chrome trace-event JSON: a named track per rank whose
/// spans nest (each inside the last one still open, or after it), every span
/// of a step inside that step and together covering it, with modules, ops,
/// collectives, FSDP regions and memory samples present.
#[test]
fn trace_spans_nest_inside_their_steps_on_every_rank() {
    let (_, v) = fsdp_tp_json("--trace", 2);
    let events = v["traceEvents"].as_array().unwrap();
    for rank in 0..4u64 {
        let mine: Vec<&serde_json::Value> = events.iter().filter(|e| e["tid"] == rank).collect();
        assert!(
            mine.iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == format!("rank {rank}")),
            "rank {rank} has no named track"
        );
        let spans: Vec<(f64, f64, &str)> = mine
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| {
                let ts = e["ts"].as_f64().unwrap();
                (ts, ts + e["dur"].as_f64().unwrap(), e["cat"].as_str().unwrap())
            })
            .collect();
        for cat in ["step", "module", "op", "collective", "fsdp"] {
            assert!(spans.iter().any(|s| s.2 == cat), "rank {rank} has no {cat} span");
        }
        assert!(mine.iter().any(|e| e["ph"] == "C"), "rank {rank} has no memory samples");
        // Nesting: sorted by start (outer first), each span ends before the
        // innermost open span that contains its start ends (0.002 µs of rounding).
        let mut sorted = spans.clone();
        sorted.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap().then(b.1.partial_cmp(&a.1).unwrap()));
        let mut open: Vec<(f64, f64)> = Vec::new();
        for &(s, e, cat) in &sorted {
            while open.last().is_some_and(|&(_, end)| end <= s + 0.002) {
                open.pop();
            }
            if let Some(&(_, end)) = open.last() {
                assert!(
                    e <= end + 0.002,
                    "rank {rank}: a {cat} span [{s}, {e}] crosses the end {end} of its parent"
                );
            } else {
                assert_eq!(cat, "step", "rank {rank}: a {cat} span at {s} lies outside every step");
            }
            open.push((s, e));
        }
        assert_eq!(spans.iter().filter(|s| s.2 == "step").count(), 2);
        // Cover: the spans inside each step account for its time (93-98% on 2
        // cores; at least 60%, a margin for a rank descheduled between spans
        // on a busy machine).
        for &(s0, s1, _) in spans.iter().filter(|s| s.2 == "step") {
            let mut inside: Vec<(f64, f64)> = spans
                .iter()
                .filter(|s| s.2 != "step" && s.0 >= s0 && s.1 <= s1 + 0.002)
                .map(|s| (s.0, s.1))
                .collect();
            inside.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
            let (mut covered, mut reach) = (0.0, s0);
            for (a, b) in inside {
                covered += (b.min(s1) - a.max(reach)).max(0.0);
                reach = reach.max(b);
            }
            assert!(
                covered >= 0.6 * (s1 - s0),
                "rank {rank}: the spans of the step at {s0} cover {covered:.1} of its {:.1} µs",
                s1 - s0
            );
        }
        // The communication track: FSDP's asynchronous gathers and
        // reduce-scatters as they ran on the rank's communication thread.
        let track = 1_000_000 + rank;
        assert!(
            events.iter().any(|e| e["ph"] == "M"
                && e["tid"] == track
                && e["args"]["name"] == format!("rank {rank} communication")),
            "rank {rank} has no communication track"
        );
        let runs: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X" && e["tid"] == track).collect();
        assert!(runs.iter().all(|e| e["cat"] == "communication"), "{runs:?}");
        for kind in ["all_gather dp", "reduce_scatter dp"] {
            assert!(
                runs.iter()
                    .any(|e| e["name"] == kind && e["args"]["bytes"].as_u64() > Some(0)),
                "rank {rank} has no {kind} run: {runs:?}"
            );
        }
    }
}

/// `--op-log` of FSDP over TP: the reference plan redistributes nothing
/// implicitly; its explicit redistributes include each row-parallel output,
/// from a pending sum over tp to replicated, in the layout notation
/// `(Shard(0), Partial(sum))`.
#[test]
fn op_log_of_the_tp_plan_has_no_implicit_redistribute() {
    let (_, v) = fsdp_tp_json("--op-log", 1);
    let ops = v["ops"].as_array().unwrap();
    assert!(ops.len() > 100, "{} ops", ops.len());
    let implicit: Vec<&serde_json::Value> = ops
        .iter()
        .filter(|o| o["explicit"] == false && !o["moved"].as_array().unwrap().is_empty())
        .collect();
    assert!(implicit.is_empty(), "implicit redistributes: {implicit:?}");
    for block in ["layers.0", "layers.1"] {
        let wo: Vec<&serde_json::Value> = ops
            .iter()
            .filter(|o| o["module"] == format!("{block}.attention.wo") && o["explicit"] == true)
            .collect();
        assert_eq!(wo.len(), 1, "{wo:?}");
        assert_eq!(wo[0]["inputs"][0]["placements"], "(Shard(0), Partial(sum))");
        assert_eq!(wo[0]["output"]["placements"], "(Shard(0), Replicate)");
        // Its plan: one all-reduce over tp of this rank's piece (f32 [2, 32, 64]
        // of the global batch [4, 32, 64] sharded over dp), of which a rank of
        // two sends 2 (b − b/2) = b bytes.
        let plan = wo[0]["moved"][0]["plan"].as_array().unwrap();
        assert_eq!(plan.len(), 1, "{plan:?}");
        assert_eq!(plan[0]["kind"], "all_reduce");
        assert_eq!(plan[0]["mesh_dims"], "tp");
        assert_eq!(plan[0]["bytes"], 2 * 32 * 64 * 4);
    }
}

/// `op_log_diff` on op logs with values: one rank, FSDP on 2 and FSDP over
/// TP on 2 × 2 agree op for op; a run with another learning rate first
/// differs at the first op of step 2 that reads a parameter (the positional
/// embedding), not before.
#[test]
fn op_log_diff_names_the_first_op_that_differs() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-opdiff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = |name: &str, args: &[&str]| {
        let p = dir.join(name);
        let mut all = vec!["--steps", "2", "--op-log", p.to_str().unwrap(), "--op-log-values"];
        all.extend(args);
        let out = train(&all, &[]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        p
    };
    let one = log("one.json", &["--world-size", "1", "--batch", "4"]);
    let fsdp = log("fsdp.json", &["--world-size", "2", "--batch", "2"]);
    let tp = log("tp.json", &["--world-size", "4", "--tp", "2", "--batch", "2"]);
    let lr = log("lr.json", &["--world-size", "1", "--batch", "4", "--lr", "0.002"]);
    let diff = |a: &std::path::Path, b: &std::path::Path| {
        Command::new(example_exe("op_log_diff")).args([a, b]).output().unwrap()
    };
    for other in [&fsdp, &tp] {
        let out = diff(&one, other);
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains("ops agree within 1e-4"), "{said}");
    }
    let ops: serde_json::Value = serde_json::from_slice(&std::fs::read(&one).unwrap()).unwrap();
    let ops: Vec<&serde_json::Value> = ops["ops"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["explicit"] == false)
        .collect();
    let second_step = ops
        .iter()
        .enumerate()
        .filter(|(_, o)| o["module"] == "pos_embeddings" && o["op"] == "embedding")
        .nth(1)
        .map(|(i, _)| i)
        .unwrap();
    let out = diff(&one, &lr);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(
        said.starts_with(&format!(
            "first difference at op {second_step}: embedding in pos_embeddings"
        )),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A checkpoint PyTorch wrote (tests/data/pytorch_checkpoint_gpt: FSDP2 on 2
/// gloo ranks, the tiny GPT after step 4 of `scripts/interop_resume.py`, its
/// keys Tessera's, no training state) continues under `train --resume DIR
/// --resume-step 4` with PyTorch's own losses of steps 5 to 8, on PyTorch's mesh
/// and on FSDP over TP; without `--resume-step` the run stops, saying so.
#[test]
fn train_continues_a_run_pytorch_checkpointed() {
    let data = |f: &str| format!("{}/tests/data/{f}", env!("CARGO_MANIFEST_DIR"));
    let ck = data("pytorch_checkpoint_gpt/step_000004");
    let want = losses(std::path::Path::new(&data("pytorch_checkpoint_gpt/losses.json")));
    let base = [
        "--init",
        &data("tiny_init.safetensors"),
        "--tokens",
        &data("tiny_tokens_G16.safetensors"),
        "--batch",
        "4",
        "--steps",
        "8",
        "--resume",
        &ck,
    ]
    .map(String::from);
    for (i, mesh) in [&["--world-size", "2"][..], &["--world-size", "4", "--tp", "2"]]
        .iter()
        .enumerate()
    {
        let out_path = std::env::temp_dir().join(format!("tessera-cli-from-pytorch-{}-{i}.json", std::process::id()));
        let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
        args.extend_from_slice(mesh);
        let out = out_path.to_string_lossy().into_owned();
        args.extend(["--resume-step", "4", "--losses-out", &out]);
        let o = train(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let got = losses(&out_path);
        // Host memory per rank: in use, and reserved with the host cache (never less).
        let v = read_json(&out_path);
        let (used, reserved) = (
            u64_column(&v, "peak_bytes_per_rank"),
            u64_column(&v, "peak_reserved_bytes_per_rank"),
        );
        assert!(used.len() == reserved.len() && used.iter().zip(&reserved).all(|(u, r)| *u > 0 && r >= u));
        let _ = std::fs::remove_file(&out_path);
        assert_eq!(got.len(), 4, "{mesh:?}: steps 5 to 8");
        for (g, w) in got.iter().zip(&want[4..]) {
            assert!((g - w).abs() <= 1e-6, "{mesh:?}: loss {g} where PyTorch had {w}");
        }
    }
    let mut args: Vec<&str> = base.iter().map(String::as_str).collect();
    args.extend(["--world-size", "2"]);
    let o = train(&args, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--resume-step"), "{err}");
    let o = train(&["--world-size", "1", "--steps", "1", "--resume-step", "3"], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("give --resume DIR too"), "{err}");
}

/// `--plan` plans the step without training and `--plan-out` writes it:
/// every rank's planned peak is the real run's measured peak (`--losses-out`,
/// the same configuration), on FSDP and on FSDP over TP; the collectives
/// match the layout (no reduce-scatter without FSDP's gradients), and the
/// run itself then prints its prediction against what it measured.
#[test]
fn plan_predicts_the_peak_of_the_run() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-plan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (i, mesh) in [&["--world-size", "2"][..], &["--world-size", "4", "--tp", "2"]]
        .iter()
        .enumerate()
    {
        let (plan, run) = (dir.join(format!("plan{i}.json")), dir.join(format!("run{i}.json")));
        let mut args = vec!["--steps", "4"];
        args.extend_from_slice(mesh);
        let mut planning = args.clone();
        let plan_s = plan.to_string_lossy().into_owned();
        planning.extend(["--plan", "--plan-out", &plan_s]);
        let o = train(&planning, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            text.contains("planned step") && !text.contains("done on mesh"),
            "{text}"
        );
        let run_s = run.to_string_lossy().into_owned();
        args.extend(["--losses-out", &run_s]);
        let o = train(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            text.contains("predicted against measured")
                && text.contains("(median after two warm-up steps)")
                && !text.contains("NaN"),
            "{text}"
        );
        let (planned, measured) = (
            u64_column(&read_json(&plan), "peak_bytes_per_rank"),
            u64_column(&read_json(&run), "peak_bytes_per_rank"),
        );
        assert_eq!(planned, measured, "{mesh:?}: planned and measured peaks per rank");
        let p = read_json(&plan);
        assert!(p["step_time_s"].as_f64().unwrap() > 0.0);
        let kinds: Vec<&str> = p["ranks"][0]["collectives"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["collective"].as_str().unwrap())
            .collect();
        assert!(
            kinds.contains(&"all_gather") && kinds.contains(&"reduce_scatter"),
            "{kinds:?}"
        );
        if i == 1 {
            assert!(
                kinds.contains(&"all_reduce"),
                "TP's row-parallel layers all-reduce: {kinds:?}"
            );
        }
    }
    // A run of only warm-up steps still compares a measured time.
    let o = train(&["--world-size", "2", "--steps", "2"], &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("(median, warm-up steps included)") && !text.contains("NaN"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--auto` without `--plan` trains the layout it picked, within the budget,
/// and its search covers the sequence-parallel TP plan and recomputing one
/// block in `n`.
#[test]
fn auto_trains_the_layout_it_picked() {
    let path = std::env::temp_dir().join(format!("tessera-cli-auto-{}.json", std::process::id()));
    let p = path.to_string_lossy().into_owned();
    let o = train(
        &[
            "--world-size",
            "4",
            "--n-layers",
            "4",
            "--steps",
            "3",
            "--auto",
            "--memory-budget",
            "3MiB",
            "--losses-out",
            &p,
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let picked: Vec<&str> = text.lines().filter(|l| l.starts_with('*')).collect();
    assert_eq!(picked.len(), 1, "{text}");
    assert!(text.contains("done on mesh"), "{text}");
    for layout in [
        "fsdp 2 + tp 2 (sequence parallel)",
        "fsdp 4, recompute 1 in 2",
        "fsdp 4, recompute 1 in 3",
    ] {
        assert!(
            text.lines().any(|l| l[2..].starts_with(layout)),
            "{layout} not planned:\n{text}"
        );
    }
    let v = read_json(&path);
    let peaks = u64_column(&v, "peak_bytes_per_rank");
    assert!(
        peaks.len() == 4 && peaks.iter().all(|&b| b <= 3 << 20),
        "peaks {peaks:?} over the 3 MiB budget:\n{text}"
    );
    let _ = std::fs::remove_file(&path);
}

/// `--auto --memory-budget` plans every layout of the ranks and picks the
/// fastest that fits: the pick's planned peak is within the budget, a budget
/// below every layout's peak is an error naming the smallest peak, and a bad
/// size is refused.
#[test]
fn auto_picks_a_layout_that_fits_the_budget() {
    let run = |budget: &str| {
        train(
            &["--world-size", "4", "--auto", "--memory-budget", budget, "--plan"],
            &[],
        )
    };
    let o = run("64MiB");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let picked: Vec<&str> = text.lines().filter(|l| l.starts_with('*')).collect();
    assert_eq!(picked.len(), 1, "{text}");
    for layout in [
        "fsdp 4",
        "hsdp 2x2",
        "fsdp 2 + tp 2",
        "fsdp 1 + tp 4, no reshard, bf16",
        "fsdp 4, reshard to 2",
        "hsdp 2x2, bf16, recompute",
    ] {
        assert!(
            text.lines().any(|l| l[2..].starts_with(layout)),
            "{layout} not planned:\n{text}"
        );
    }
    // The smallest planned peak (in KiB), and a budget just below it: nothing fits.
    let peak = |l: &str| -> f64 {
        let mut words = l.split("peak").nth(1).unwrap().split_whitespace();
        let v: f64 = words.next().unwrap().parse().unwrap();
        match words.next().unwrap() {
            "B" => v / 1024.0,
            "KiB" => v,
            "MiB" => v * 1024.0,
            "GiB" => v * 1024.0 * 1024.0,
            u => panic!("unit {u} in {l}"),
        }
    };
    let least = text
        .lines()
        .filter(|l| l.contains(" peak "))
        .map(peak)
        .fold(f64::INFINITY, f64::min);
    let o = run(&format!("{}KiB", (least * 0.9) as usize));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("no layout of 4 ranks fits") && err.contains("smallest planned peak"),
        "{err}"
    );
    let o = run("2XB");
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("the unit must be"));
    let o = train(
        &["--world-size", "4", "--tp", "2", "--auto", "--memory-budget", "1GiB"],
        &[],
    );
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--auto chooses"));
}

/// `--activation-checkpointing` trains the same model (the same losses, bit
/// for bit) with a smaller peak, as its plan predicts; `--reshard-to` and
/// `--fsdp-units split-ends` are planned and run alike; bad values and
/// combinations are refused by name.
#[test]
fn recomputed_blocks_and_resharding_to_groups_train_the_same_model() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-ac-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let peak = |v: &serde_json::Value| -> u64 { u64_column(v, "peak_bytes_per_rank").into_iter().max().unwrap() };
    let mut runs = Vec::new();
    for (i, extra) in [
        &[][..],
        &["--activation-checkpointing", "full"],
        &["--reshard-to", "2"],
        &["--fsdp-units", "split-ends"],
    ]
    .iter()
    .enumerate()
    {
        let (plan, out) = (dir.join(format!("plan{i}.json")), dir.join(format!("run{i}.json")));
        let (plan_s, out_s) = (plan.to_string_lossy().into_owned(), out.to_string_lossy().into_owned());
        // A model whose activations outweigh its parameters: 8 rows per rank.
        let mut args = vec!["--world-size", "4", "--steps", "4", "--batch", "8"];
        args.extend_from_slice(extra);
        let mut planning = args.clone();
        planning.extend(["--plan", "--plan-out", &plan_s]);
        let o = train(&planning, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        args.extend(["--losses-out", &out_s]);
        let o = train(&args, &[]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let (p, r) = (read_json(&plan), read_json(&out));
        assert_eq!(peak(&p), peak(&r), "{extra:?}: planned and measured peaks");
        runs.push((losses(&out), peak(&r), text));
    }
    assert_eq!(runs[1].0, runs[0].0, "recomputation changes no loss");
    assert_eq!(runs[2].0, runs[0].0, "resharding to groups changes no loss");
    assert_eq!(runs[3].0, runs[0].0, "other FSDP units change no loss");
    assert!(
        runs[1].1 < runs[0].1,
        "recomputed blocks peak at {} bytes, kept ones at {}",
        runs[1].1,
        runs[0].1
    );
    assert!(
        runs[1].2.contains("every block recomputed in backward"),
        "{}",
        runs[1].2
    );
    assert!(runs[2].2.contains("resharded to groups of 2"), "{}", runs[2].2);
    for (args, want) in [
        (&["--activation-checkpointing", "half"][..], "use none, full, or N"),
        (&["--reshard-to", "2", "--no-reshard"], "give one"),
        (&["--reshard-to", "3"], "must divide the 4 ranks"),
        (&["--fsdp-units", "all"], "blocks or split-ends"),
    ] {
        let mut a = vec!["--world-size", "4", "--steps", "1"];
        a.extend_from_slice(args);
        let o = train(&a, &[]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--machine PATH` calibrates once and saves the constants; a later plan
/// reads them (the same constants in its JSON, no new calibration); a file of
/// another world size, or not of constants, is refused by name.
#[test]
fn machine_constants_are_saved_once_and_read_back() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-machine-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let machine = dir.join("machine.json");
    let m = machine.to_string_lossy().into_owned();
    let plan = |world: &str, out: &str| {
        train(
            &["--world-size", world, "--plan", "--machine", &m, "--plan-out", out],
            &[],
        )
    };
    let (first, second) = (dir.join("a.json"), dir.join("b.json"));
    let o = plan("2", &first.to_string_lossy());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("calibrated the machine for 2 ranks"));
    let saved = read_json(&machine);
    assert_eq!(saved["ranks"], 2);
    let o = plan("2", &second.to_string_lossy());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stdout).contains("calibrated"));
    let (a, b) = (read_json(&first), read_json(&second));
    assert_eq!(a["machine"], saved);
    assert_eq!(b["machine"], saved, "the second plan reads the saved constants");
    assert_eq!(a["step_time_s"], b["step_time_s"]);
    let o = plan("4", &second.to_string_lossy());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("calibrated with 2 ranks"), "{err}");
    std::fs::write(&machine, "{\"flops_per_s\": 1e9}").unwrap();
    let o = plan("2", &second.to_string_lossy());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("half_flops_per_s"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--losses-out` counts the process's minor page faults per step, and with
/// the host cache a steady-state step faults almost none: its buffers (over
/// 256 KiB here: logits, gathered units, gradient buckets) come back from the
/// cache instead of fresh pages (the first step faults them all).
#[test]
fn steady_steps_fault_no_fresh_pages() {
    let out_path = std::env::temp_dir().join(format!("tessera-cli-faults-{}.json", std::process::id()));
    let out = out_path.to_string_lossy().into_owned();
    let o = train(
        &[
            "--world-size",
            "2",
            "--steps",
            "8",
            "--dim",
            "128",
            "--n-layers",
            "2",
            "--n-heads",
            "4",
            "--vocab",
            "2048",
            "--seq",
            "64",
            "--batch",
            "4",
            "--losses-out",
            &out,
        ],
        &[],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let log = String::from_utf8_lossy(&o.stdout);
    assert!(log.contains("minor page faults per step after the first two"), "{log}");
    let faults = u64_column(&read_json(&out_path), "minor_faults_per_step");
    let _ = std::fs::remove_file(&out_path);
    assert_eq!(faults.len(), 8, "{faults:?}");
    assert!(faults[0] > 1000, "the first step maps its buffers: {faults:?}");
    let mut steady = faults[2..].to_vec();
    steady.sort_unstable();
    assert!(
        steady[steady.len() / 2] * 100 <= faults[0],
        "steady steps fault fresh pages: {faults:?}"
    );
    assert!(
        steady.iter().all(|&f| f * 4 <= faults[0]),
        "a steady step faults fresh pages: {faults:?}"
    );
}

/// `bench_redistribute --case TEXT` times only the cases whose name contains
/// the text (the rows a user measures again), and refuses a text that no
/// case's name contains, listing the names.
#[test]
fn bench_redistribute_runs_the_cases_asked_for() {
    let wanted = "(Shard(0), Shard(0))->(Shard(1), Shard(1))";
    let json = std::env::temp_dir().join(format!("tessera-cli-bench-case-{}.json", std::process::id()));
    let json_arg = json.to_str().unwrap().to_string();
    let o = Command::new(example_exe("bench_redistribute"))
        .args(["--case", wanted, "--iters", "1", "--json", &json_arg])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let records = read_json(&json);
    let _ = std::fs::remove_file(&json);
    let cases: Vec<&str> = records
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r.get("case").and_then(|c| c.as_str()))
        .collect();
    assert_eq!(cases, [wanted], "one row, the one asked for");
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains(wanted), "{table}");
    assert!(
        !table.contains("(Shard(0), Replicate)->(Replicate, Replicate)"),
        "{table}"
    );

    let o = Command::new(example_exe("bench_redistribute"))
        .args(["--case", "(Shard(7)"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no case's name contains --case \"(Shard(7)\""), "{err}");
    assert!(err.contains(wanted), "the message lists the cases: {err}");
}

/// `bench_fsdp --profile` ends with each FSDP unit's collectives (gathers a
/// step: 1 for the root, kept from forward to backward, 2 for each block),
/// and the fsdp record of `--json` sums their times; the single-rank mode,
/// which communicates nothing, has neither.
#[test]
fn bench_fsdp_reports_each_units_collectives() {
    let json = std::env::temp_dir().join(format!("tessera-cli-bench-fsdp-{}.json", std::process::id()));
    let json_arg = json.to_str().unwrap().to_string();
    let o = Command::new(example_exe("bench_fsdp"))
        .args(["--config", "tiny", "--steps", "2", "--profile", "--json", &json_arg])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let table = String::from_utf8_lossy(&o.stdout);
    let section = table
        .split("rank 0's FSDP collectives per unit, fsdp")
        .nth(1)
        .unwrap_or_else(|| panic!("no per-unit table: {table}"));
    let gathers: Vec<(String, String)> = section
        .lines()
        .skip(2)
        .take(4)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_string(), f[1].to_string())
        })
        .collect();
    let want = [
        ("root", "1.0"),
        ("layers.0", "2.0"),
        ("layers.1", "2.0"),
        ("all", "5.0"),
    ];
    assert_eq!(gathers, want.map(|(a, b)| (a.to_string(), b.to_string())), "{section}");
    let records = read_json(&json);
    let _ = std::fs::remove_file(&json);
    let fields = [
        "all_gather_ms_per_step",
        "all_gather_exposed_ms_per_step",
        "reduce_scatter_ms_per_step",
        "reduce_scatter_exposed_ms_per_step",
    ];
    for r in records.as_array().unwrap() {
        let mode = r.get("mode").and_then(|m| m.as_str()).unwrap();
        for f in fields {
            match (mode, r.get(f).and_then(|v| v.as_f64())) {
                ("fsdp", Some(v)) => assert!(v >= 0.0, "{f}: {v}"),
                ("single", None) => {}
                other => panic!("{f} in the {mode} record: {other:?}"),
            }
        }
    }
    assert!(
        records.as_array().unwrap().iter().any(|r| r
            .get("all_gather_ms_per_step")
            .and_then(|v| v.as_f64())
            .unwrap_or(0.0)
            > 0.0),
        "the gathers ran for some time: {records}"
    );
}

/// `train` from a seed starts every layout from the same model: one rank,
/// FSDP 2, FSDP 2 × TP 2 and HSDP 2×2 × TP 2 save byte-identical consolidated
/// files before any update (learning rate 0), and with the global batch fixed
/// their losses agree within 1e-6 at every step.
#[test]
fn training_from_a_seed_starts_every_layout_from_the_same_model() {
    let dir = std::env::temp_dir().join(format!("tessera-cli-seed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let layouts: [&[&str]; 4] = [
        &["--world-size", "1", "--batch", "8"],
        &["--world-size", "2", "--batch", "4"],
        &["--world-size", "4", "--tp", "2", "--batch", "4"],
        &["--mesh", "2x2", "--tp", "2", "--batch", "2"],
    ];
    let mut files = Vec::new();
    let mut losses = Vec::new();
    for (i, layout) in layouts.iter().enumerate() {
        let (full, json) = (
            dir.join(format!("init{i}.safetensors")),
            dir.join(format!("losses{i}.json")),
        );
        let (full_s, json_s) = (full.to_string_lossy().into_owned(), json.to_string_lossy().into_owned());
        let mut init = layout.to_vec();
        init.extend(["--seed", "7", "--steps", "1", "--lr", "0", "--save-full", &full_s]);
        let o = train(&init, &[]);
        assert!(o.status.success(), "{layout:?}: {}", String::from_utf8_lossy(&o.stderr));
        files.push(std::fs::read(&full).unwrap());
        let mut run = layout.to_vec();
        run.extend(["--seed", "7", "--steps", "3", "--losses-out", &json_s]);
        let o = train(&run, &[]);
        assert!(o.status.success(), "{layout:?}: {}", String::from_utf8_lossy(&o.stderr));
        let v = read_json(&json);
        let l: Vec<f64> = v["loss"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(l.len(), 3, "{layout:?}: {v}");
        losses.push(l);
    }
    for (i, layout) in layouts.iter().enumerate().skip(1) {
        assert!(
            files[i] == files[0],
            "{layout:?}: another initial model than one rank's"
        );
        for (step, (a, b)) in losses[i].iter().zip(&losses[0]).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6,
                "{layout:?}, step {}: loss {a} against one rank's {b}",
                step + 1
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
