//! Watching a parallel program: the op log marks implicit and explicit
//! redistributes in one notation, the collective report puts each collective
//! under its module and phase and sums to the mesh counters.

use tessera::autograd::nn::{Linear, Materializer, Module};
use tessera::autograd::{Var, backward};
use tessera::dtensor::{DType, Placement, Tensor, distribute_tensor};
use tessera::mesh::observe::{self, CommReport, Phase, What};
use tessera::mesh::{DeviceMesh, OpKind, launch};

/// An add of inputs sharded on different dims moves one of them (implicit),
/// a `redistribute` is explicit; both list the layouts, and the collectives
/// they ran lie inside their ops' spans.
#[test]
fn the_op_log_marks_implicit_and_explicit_redistributes() {
    let out = launch(2, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["dp"])?;
        let ones = Tensor::ones(&[4, 6], DType::F32)?;
        let a = distribute_tensor(&ones, &mesh, &[Placement::Shard(0)])?;
        let b = distribute_tensor(&ones, &mesh, &[Placement::Shard(1)])?;
        let rec = observe::record_ops(observe::OpLog::Values);
        let c = a.add(&b)?;
        let d = c.redistribute(&[Placement::Replicate])?;
        let events = rec.finish();
        assert_eq!(d.full_tensor()?.to_f64_vec(), vec![2.0; 24]);
        let log: Vec<String> = observe::op_log_entries(&events)
            .iter()
            .map(|(_, r)| r.to_string())
            .collect();
        let records: Vec<_> = observe::op_log_entries(&events)
            .into_iter()
            .map(|(_, r)| r.clone())
            .collect();
        Ok((log, records, events))
    })
    .unwrap();
    for (log, records, events) in out {
        assert_eq!(log.len(), 2, "{log:?}");
        assert!(
            log[0].starts_with("add(f32[4,6] (Shard(0)), f32[4,6] (Shard(1))) -> f32[4,6] (Shard(")
                && log[0].contains("on mesh(dp=2); implicit redistribute of input "),
            "{}",
            log[0]
        );
        assert!(!records[0].explicit && records[0].moved.len() == 1);
        assert_eq!(records[0].values, Some([48.0, 48.0, 48.0 * 2.0]));
        assert_eq!(records[1].op, "redistribute");
        assert!(records[1].explicit);
        let gather = &records[1].moved;
        assert!(
            gather.len() == 1 && gather[0].input == 0 && gather[0].to == "(Replicate)",
            "{gather:?}"
        );
        // Each plan is the one step that ran: its kind, mesh dim and this
        // rank's bytes are the collective's inside the op's span.
        let sent = |kind: OpKind| -> u64 {
            events
                .iter()
                .filter_map(|e| match &e.what {
                    What::Collective { kind: k, bytes, .. } if *k == kind => Some(*bytes),
                    _ => None,
                })
                .sum()
        };
        for (r, kind) in [(&records[0], OpKind::AllToAll), (&records[1], OpKind::AllGather)] {
            let plan = &r.moved[0].plan;
            assert!(
                plan.len() == 1
                    && plan[0].kind == kind.to_string()
                    && plan[0].mesh_dims == "dp"
                    && plan[0].bytes == sent(kind)
                    && plan[0].bytes > 0,
                "{}: {plan:?}",
                r.op
            );
        }
        assert!(
            log[1].ends_with(&format!(
                "explicit redistribute of input 0 to (Replicate) by all_gather over dp ({} B); sum 4.800000e1 |x| \
                 4.800000e1 x² 9.600000e1",
                sent(OpKind::AllGather)
            )),
            "{}",
            log[1]
        );
        // Each op's collectives run inside its span, over the named mesh dim.
        let spans: Vec<&observe::Event> = events.iter().filter(|e| matches!(e.what, What::Op(_))).collect();
        for (op, kind) in [("add", OpKind::AllToAll), ("redistribute", OpKind::AllGather)] {
            let s = spans.iter().find(|e| e.what == What::Op(op)).unwrap();
            let inside = events.iter().any(|e| {
                matches!(&e.what, What::Collective { kind: k, group, .. } if *k == kind && &**group == "dp")
                    && e.start_ns >= s.start_ns
                    && e.start_ns + e.dur_ns <= s.start_ns + s.dur_ns
            });
            assert!(inside, "no {kind} over dp inside {op}: {events:?}");
        }
    }
}

/// Two linear layers under a root module: forward ops are attributed to the
/// module that ran them, backward ops to the module that recorded them, and
/// the report of a data-parallel gradient all-reduce sums to the counters.
#[test]
fn modules_scope_forward_and_backward_and_the_report_sums_to_the_counters() {
    struct Net {
        first: Linear,
        second: Linear,
    }
    impl Module for Net {
        fn named_children(&self) -> Vec<(String, &dyn Module)> {
            vec![("first".into(), &self.first), ("second".into(), &self.second)]
        }
        fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
            self.second.call(&self.first.call(x)?)
        }
    }
    let out = launch(2, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["dp"])?;
        let net = Net {
            first: Linear::new(6, 5, true, &mesh, DType::F32)?,
            second: Linear::new(5, 3, true, &mesh, DType::F32)?,
        };
        Materializer::from_seed(3).materialize(&net)?;
        let x = distribute_tensor(&Tensor::ones(&[4, 6], DType::F32)?, &mesh, &[Placement::Shard(0)])?;
        let before = mesh.stats();
        let rec = observe::record();
        let loss = net.call(&Var::constant(x))?.sum(&[0usize, 1], false)?;
        backward(&loss)?;
        let events = rec.finish();
        let counters = mesh.stats() - before;
        Ok((events, counters))
    })
    .unwrap();
    for (events, counters) in out {
        let modules: Vec<(String, Phase)> = events
            .iter()
            .filter_map(|e| match &e.what {
                What::Module { fqn, phase } => Some((fqn.to_string(), *phase)),
                _ => None,
            })
            .collect();
        for (m, p) in [
            ("", Phase::Forward),
            ("first", Phase::Forward),
            ("second", Phase::Forward),
        ] {
            assert!(modules.contains(&(m.to_string(), p)), "{modules:?}");
        }
        assert!(
            modules.contains(&("second".to_string(), Phase::Backward)),
            "{modules:?}"
        );
        assert!(modules.contains(&("first".to_string(), Phase::Backward)), "{modules:?}");
        // Every matmul lies in a linear layer's scope, forward or backward.
        for e in events.iter().filter(|e| e.what == What::Op("matmul")) {
            let (m, _) = e.module.as_ref().expect("a matmul outside any module");
            assert!(&**m == "first" || &**m == "second", "matmul in {m}");
        }
        let report = CommReport::from_events(&events);
        for kind in [
            OpKind::AllGather,
            OpKind::ReduceScatter,
            OpKind::AllReduce,
            OpKind::AllToAll,
        ] {
            assert_eq!(
                report.total(kind),
                (counters.calls(kind), counters.bytes(kind)),
                "{kind}: {report}"
            );
        }
        assert!(
            counters.total_calls() > 0,
            "the replicated weights' gradients are reduced over dp"
        );
    }
}

/// An error raised inside a model names the module it was raised in (its
/// fully qualified name below the model, as `named_modules` gives it, and its
/// type), whether or not a recording is on (a recording takes the hooked path
/// of a module call); the error inside is the op's own. Called directly, a
/// layer is the outermost module.
#[test]
fn an_error_inside_a_module_names_the_module() {
    struct Block {
        proj: Linear,
    }
    impl Module for Block {
        fn named_children(&self) -> Vec<(String, &dyn Module)> {
            vec![("proj".into(), &self.proj)]
        }
        fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
            self.proj.call(x)
        }
    }
    struct Net {
        blocks: Vec<Block>,
    }
    impl Module for Net {
        fn named_children(&self) -> Vec<(String, &dyn Module)> {
            self.blocks
                .iter()
                .enumerate()
                .map(|(i, b)| (format!("blocks.{i}"), b as &dyn Module))
                .collect()
        }
        fn forward(&self, x: &Var) -> tessera::autograd::Result<Var> {
            self.blocks.iter().try_fold(x.clone(), |h, b| b.call(&h))
        }
    }
    let out = launch(1, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[1], &["dp"])?;
        let net = Net {
            blocks: vec![
                Block {
                    proj: Linear::new(4, 4, false, &mesh, DType::F32)?,
                },
                Block {
                    proj: Linear::new(4, 4, false, &mesh, DType::BF16)?,
                },
            ],
        };
        Materializer::from_seed(5).materialize(&net)?;
        let x = Var::constant(distribute_tensor(
            &Tensor::ones(&[2, 4], DType::F32)?,
            &mesh,
            &[Placement::Replicate],
        )?);
        let plain = net.call(&x).map(|_| ()).unwrap_err();
        let rec = observe::record();
        let recorded = net.call(&x).map(|_| ()).unwrap_err();
        drop(rec);
        let direct = net.blocks[1].proj.call(&x).map(|_| ()).unwrap_err();
        Ok((plain, recorded, direct))
    })
    .unwrap();
    let (plain, recorded, direct) = out.into_iter().next().unwrap();
    for e in [&plain, &recorded] {
        let tessera::autograd::Error::InModule(m) = e else {
            panic!("not tagged with its module: {e}");
        };
        assert_eq!(m.fqn(), "blocks.1.proj");
        assert_eq!(m.module_type(), "Linear");
        assert!(matches!(e.innermost(), tessera::autograd::Error::Tensor(_)), "{e:?}");
        let msg = e.to_string();
        assert!(msg.starts_with("in module blocks.1.proj (Linear): "), "{msg}");
        assert!(msg.contains("bf16") && msg.contains("f32"), "{msg}");
    }
    assert!(
        direct.to_string().starts_with("in the outermost module (Linear): "),
        "{direct}"
    );
}

/// Any asynchronous collective a recording rank waits for is recorded as its
/// run on the communication thread (`What::CommRun`), under the group name,
/// kind and bytes of its queued `Collective` event, lying after that hand-off;
/// one issued while nothing records is not recorded when waited for later.
#[test]
fn an_asynchronous_collective_waited_for_records_its_run() {
    let out = launch(2, |ctx| {
        let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2], &["dp"])?;
        let comm = mesh.dim_comm(0)?;
        let unrecorded = comm.all_reduce_async(vec![1.0f32; 64].into(), tessera::ReduceOp::Sum);
        let rec = observe::record();
        let work = comm.all_gather_async(vec![1.0f32; 256].into());
        let (got, timing) = work.wait_timed();
        assert_eq!(got?.len(), 512);
        assert_eq!(unrecorded.wait_vec::<f32>()?, vec![2.0; 64]);
        Ok((rec.finish(), timing))
    })
    .unwrap();
    for (events, timing) in out {
        let queued: Vec<&observe::Event> = events
            .iter()
            .filter(|e| matches!(e.what, What::Collective { queued: true, .. }))
            .collect();
        let runs: Vec<&observe::Event> = events
            .iter()
            .filter(|e| matches!(e.what, What::CommRun { .. }))
            .collect();
        assert_eq!((queued.len(), runs.len()), (1, 1), "{events:?}");
        let What::Collective { kind, group, bytes, .. } = &queued[0].what else {
            unreachable!()
        };
        let What::CommRun {
            kind: run_kind,
            group: run_group,
            bytes: run_bytes,
            blocked_ns,
        } = &runs[0].what
        else {
            unreachable!()
        };
        assert_eq!((*run_kind, &**run_group, *run_bytes), (*kind, &**group, *bytes));
        assert_eq!((*kind, &**group), (OpKind::AllGather, "dp"));
        assert_eq!(*blocked_ns, timing.blocked.as_nanos() as u64);
        assert_eq!(runs[0].dur_ns, timing.run().as_nanos() as u64);
        assert!(
            runs[0].start_ns >= queued[0].start_ns,
            "the run starts after the hand-off"
        );
    }
}
