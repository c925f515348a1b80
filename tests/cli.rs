//! The main job as a user meets it: Tessera variables with values they do not
//! accept stop the job naming what they accept, `train --help` lists every flag
//! with its default, and a redirected log gets progress lines, not `\r` frames.
//! (Runs the `train` example, which `cargo test` builds.)

use std::path::PathBuf;
use std::process::{Command, Output};

fn train(args: &[&str], env: &[(&str, &str)]) -> Output {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps/<test>");
    let train: PathBuf = profile_dir.join("examples").join("train");
    assert!(train.exists(), "{} is missing: `cargo test` builds it", train.display());
    let mut cmd = Command::new(&train);
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
        "--dim",
        "--n-layers",
        "--n-heads",
        "--vocab",
        "--seq",
        "--init",
        "--seed",
        "--tokens",
        "--data-seed",
        "--steps",
        "--batch",
        "--lr",
        "--losses-out",
        "--checkpoint-dir",
        "--checkpoint-every",
        "--async-save",
        "--keep-checkpoints",
        "--resume",
        "--save-full",
    ] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(flag) || l.contains(&format!(" {flag} ")))
            .unwrap_or_else(|| panic!("--help does not list {flag}:\n{help}"));
        assert!(!line.is_empty());
    }
    assert!(help.contains("default 50") && help.contains("default 0.001"), "{help}");
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
    std::fs::write(tmp.join("rank00000.safetensors"), vec![0u8; 4096]).unwrap();
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
