//! The watchdog: one thread per process that aborts the job when a collective
//! waits longer than the launch's timeout, and names the ranks it waits for.
//!
//! Each process records what it is doing ([`super::status`]). A stalled rank's main
//! thread cannot speak for itself, but its watchdog thread can, so the watchdogs
//! talk over a control communicator of their own (a duplicate of
//! `MPI_COMM_WORLD` that nothing else uses):
//!
//! - every [`POLL`], each watchdog probes the control communicator and answers
//!   each `QUERY` with a `REPLY`: one class byte and a short UTF-8 status
//!   ("waiting 3.1 s in all_reduce #5 ... (world ranks [0, 1])", "outside any
//!   collective for 3.2 s ...", "its closure has returned; ..."), and the world
//!   ranks of the groups it waits in;
//! - when a collective of this process waits longer than the timeout, its
//!   watchdog sends `QUERY` to the other members of that collective's group,
//!   collects the replies for a bounded time (answering other watchdogs' queries
//!   meanwhile: several ranks can time out at once), asks in turn the members of
//!   the groups that the waiting ones wait in, and so on, and aborts the job with
//!   the collective, the rank not progressing (the nearest rank reached that
//!   waits in no collective, with the waits that lead to it) and each peer's
//!   status; a peer that did not answer is named as such;
//! - a process that finalises MPI (at its exit, or because the application
//!   called `MPI_Finalize`) first sends `EXITING` with its last status to every
//!   peer (see [`finalizing`] for when), then stops its own watchdog's MPI calls.
//!
//! Sends are nonblocking (`MPI_Isend`, then `MPI_Test`), so a gone peer never
//! blocks a watchdog. Every MPI call of the watchdog is made under the
//! [`CONTROL`] lock, after checking that MPI is not being finalised.

use std::collections::{BTreeMap, BTreeSet};
use std::os::raw::{c_int, c_void};
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use mpi::ffi;

use super::messages::abort_with;
use super::ops::Handle;
use super::status::{
    EXIT_AFTER_RETURN, EXIT_BY_EXIT, Expired, Peer, Reached, Snapshot, blame_lines, closure_returned, describe, epoch,
    expired, not_progressing, reply, report, secs, snapshot,
};

/// How long a collective may wait before the watchdog aborts the job.
pub(super) static TIMEOUT_MS: AtomicU64 = AtomicU64::new(300_000);
/// Set when the process exits (Tessera's atexit handler finalises MPI).
static EXITING: AtomicBool = AtomicBool::new(false);
/// The control communicator and the watchdog's sends in flight.
static CONTROL: Mutex<Control> = Mutex::new(Control {
    state: State::Off,
    world_rank: 0,
    world_size: 0,
    pending: Vec::new(),
});

/// How often the watchdog answers queries and checks the clocks.
const POLL: Duration = Duration::from_millis(10);
const TAG_QUERY: c_int = 1;
const TAG_REPLY: c_int = 2;
const TAG_EXITING: c_int = 3;
/// The longest control message (the statuses are one line).
const MAX_MESSAGE: usize = 4096;
/// A process that exits after its closure returned tells its peers so only in
/// worlds up to this size: every process does it at a normal exit, which costs
/// `n²` messages (and connections) over the job.
const NOTICE_ALL_UP_TO: usize = 64;

#[derive(Clone, Copy, Debug)]
enum State {
    /// No control communicator: timeouts abort without asking the peers.
    Off,
    Live(Handle<ffi::MPI_Comm>),
    /// MPI is being finalised: the watchdog makes no more MPI calls.
    Stopped,
}

/// A nonblocking send in flight and the buffer it reads.
struct Outgoing {
    req: Handle<ffi::MPI_Request>,
    buf: Box<[u8]>,
}

/// The watchdog's MPI state, behind [`CONTROL`].
struct Control {
    state: State,
    world_rank: usize,
    world_size: usize,
    pending: Vec<Outgoing>,
}

/// The [`CONTROL`] lock, with the state set to `Stopped` if MPI was finalised.
fn control() -> MutexGuard<'static, Control> {
    let mut c = CONTROL.lock().unwrap_or_else(PoisonError::into_inner);
    if !matches!(c.state, State::Stopped) && mpi::environment::is_finalized() {
        c.state = State::Stopped;
    }
    c
}

impl Control {
    fn comm(&self) -> Option<ffi::MPI_Comm> {
        match self.state {
            State::Live(h) => Some(h.get()),
            State::Off | State::Stopped => None,
        }
    }

    /// Starts sending `buf` (not empty) to world rank `dest`.
    fn isend(&mut self, dest: usize, tag: c_int, buf: Box<[u8]>) {
        let Some(comm) = self.comm() else { return };
        let (Ok(n), Ok(to)) = (c_int::try_from(buf.len()), c_int::try_from(dest)) else {
            return;
        };
        if buf.is_empty() || dest >= self.world_size {
            return;
        }
        // SAFETY: reading predefined handles after MPI_Init.
        let (mut req, dt) = unsafe { (ffi::RSMPI_REQUEST_NULL, ffi::RSMPI_UINT8_T) };
        // SAFETY: `buf` holds `n` bytes and is kept alive in `pending` until the send
        // completes (or leaked); `comm` is live (state Live, under the lock).
        let rc = unsafe { ffi::MPI_Isend(buf.as_ptr().cast(), n, dt, to, tag, comm, &mut req) };
        if rc == 0 {
            self.pending.push(Outgoing { req: Handle(req), buf });
        }
    }

    /// Forgets the sends that completed.
    fn test_pending(&mut self) {
        self.pending.retain_mut(|o| {
            let mut done: c_int = 0;
            // SAFETY: `o.req` is an active request of this process; a valid out-pointer
            // and MPI_STATUS_IGNORE.
            let rc = unsafe { ffi::MPI_Test(&mut o.req.0, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            if rc != 0 {
                // The request's state is unknown: MPI may still read the buffer.
                std::mem::forget(std::mem::take(&mut o.buf));
                return false;
            }
            done == 0
        });
    }

    /// Receives one waiting control message: its source, tag and bytes.
    fn receive(&mut self) -> Option<(usize, c_int, Vec<u8>)> {
        let comm = self.comm()?;
        let mut flag: c_int = 0;
        // SAFETY: MPI_Status is a plain C struct; all zeroes is a valid value.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: `comm` is live; out-pointers are valid.
        let rc = unsafe { ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, ffi::RSMPI_ANY_TAG, comm, &mut flag, &mut status) };
        if rc != 0 || flag == 0 {
            return None;
        }
        let (src, tag) = (status.MPI_SOURCE, status.MPI_TAG);
        let mut count: c_int = 0;
        // SAFETY: `status` was filled by MPI_Iprobe; reading a predefined datatype.
        unsafe { ffi::MPI_Get_count(&status, ffi::RSMPI_UINT8_T, &mut count) };
        // A longer message (none of ours) is received truncated, an error: dropped.
        let len = usize::try_from(count).unwrap_or(0).clamp(1, MAX_MESSAGE);
        let mut buf = vec![0u8; len];
        let n = c_int::try_from(len).ok()?;
        // SAFETY: `buf` holds `n` bytes; the probed message is waiting, so this returns
        // at once (only this thread receives on the control communicator).
        let rc = unsafe {
            ffi::MPI_Recv(
                buf.as_mut_ptr().cast(),
                n,
                ffi::RSMPI_UINT8_T,
                src,
                tag,
                comm,
                &mut status,
            )
        };
        if rc != 0 {
            return None;
        }
        buf.truncate(usize::try_from(count).unwrap_or(0));
        Some((usize::try_from(src).ok()?, tag, buf))
    }

    /// Frees (lets complete) the sends in flight and makes no more MPI calls.
    fn stop(&mut self) {
        let live = self.comm().is_some();
        for mut o in self.pending.drain(..) {
            if live {
                // SAFETY: `o.req` is an active send request and MPI is not finalised
                // (state Live, under the lock); freeing it lets the send complete.
                unsafe { ffi::MPI_Request_free(&mut o.req.0) };
            }
            // MPI may still read the buffer: leaked, not freed under it.
            std::mem::forget(o.buf);
        }
        self.state = State::Stopped;
    }
}

/// Starts the watchdog thread; `comm` is its control communicator (a duplicate of
/// the world that nothing else uses), `None` if it could not be made.
pub(super) fn start(world_rank: usize, world_size: usize, comm: Option<ffi::MPI_Comm>) {
    epoch();
    {
        let mut c = control();
        c.world_rank = world_rank;
        c.world_size = world_size;
        c.state = comm.map_or(State::Off, |c| State::Live(Handle(c)));
    }
    if comm.is_some() {
        notify_at_finalize();
    }
    let spawned = std::thread::Builder::new()
        .name("tessera-mpi-watchdog".into())
        .spawn(move || run(world_rank, world_size));
    if let Err(e) = spawned {
        eprintln!("tessera: rank {world_rank}: could not start the MPI watchdog ({e}); collectives will not time out");
    }
}

/// Peers' `EXITING` notices, by world rank.
type Exits = BTreeMap<usize, Peer>;

/// Answers queries and records notices (replies into `replies`); `false` once stopped.
fn serve(exits: &mut Exits, mut replies: Option<&mut BTreeMap<usize, Peer>>) -> bool {
    let mut c = control();
    if matches!(c.state, State::Stopped) {
        return false;
    }
    // A bounded number per round, so that the lock is never held long.
    for _ in 0..64 {
        let Some((src, tag, body)) = c.receive() else { break };
        match tag {
            TAG_QUERY => {
                let msg = reply(&snapshot(), MAX_MESSAGE);
                c.isend(src, TAG_REPLY, msg.into_boxed_slice());
            }
            TAG_REPLY => {
                if let Some(r) = replies.as_deref_mut() {
                    r.insert(src, Peer::from_reply(&body));
                }
            }
            TAG_EXITING => {
                exits.insert(src, Peer::from_exit(&body));
            }
            _ => {}
        }
    }
    c.test_pending();
    true
}

fn run(world_rank: usize, world_size: usize) {
    let mut exits = Exits::new();
    loop {
        std::thread::sleep(POLL);
        if !serve(&mut exits, None) {
            return;
        }
        let timeout = TIMEOUT_MS.load(Ordering::Relaxed);
        if let Some(e) = expired(timeout) {
            abort_for(world_rank, world_size, timeout, &e, &mut exits);
            return;
        }
    }
}

/// Asks the other members of the expired collective's group what they do, then
/// the members of the groups those that wait wait in, and so on, and aborts the
/// job naming the rank not progressing and the peers. Returns only if MPI is
/// being finalised.
fn abort_for(world_rank: usize, world_size: usize, timeout_ms: u64, e: &Expired, exits: &mut Exits) {
    let members = if e.members.is_empty() {
        (0..world_size).collect()
    } else {
        e.members.clone()
    };
    let peers: Vec<usize> = members.into_iter().filter(|&r| r != world_rank).collect();
    // Every rank reached, in the order reached, with the rank whose wait led to it.
    let mut reached: Vec<(usize, Option<usize>)> = peers.iter().map(|&r| (r, None)).collect();
    let mut seen: BTreeSet<usize> = peers.iter().copied().chain([world_rank]).collect();
    let live = ask(&peers, exits);
    let mut replies = BTreeMap::new();
    let window = Duration::from_millis((timeout_ms / 2).clamp(500, 5000));
    let until = Instant::now() + window;
    let mut followed = BTreeSet::new();
    let answered =
        |r: &usize, replies: &BTreeMap<usize, Peer>, exits: &Exits| replies.contains_key(r) || exits.contains_key(r);
    while live && Instant::now() < until && reached.iter().any(|(r, _)| !answered(r, &replies, exits)) {
        std::thread::sleep(POLL);
        if !serve(exits, Some(&mut replies)) {
            return;
        }
        // Follow the waits of the ranks that answered since.
        let more = follow_waits(&mut reached, &replies, &mut followed, &mut seen, world_size);
        if !more.is_empty() {
            ask(&more, exits);
        }
    }
    let status = |r: usize| {
        exits
            .get(&r)
            .or_else(|| replies.get(&r))
            .cloned()
            .unwrap_or(Peer::Silent)
    };
    let statuses: Vec<(usize, Peer)> = peers.iter().map(|&r| (r, status(r))).collect();
    let reached: Vec<Reached> = reached.iter().map(|&(r, via)| (r, via, status(r))).collect();
    let (why, details) = explain(e, live, &statuses, &reached);
    // Held while aborting: MPI must not be finalised under MPI_Abort.
    let c = control();
    if matches!(c.state, State::Stopped) {
        return;
    }
    abort_with(world_rank, &why, &details);
}

/// What the abort says: the wait that expired (`why`), and, if the peers could
/// be asked (`live`), who is not progressing and what each peer reported.
fn explain(e: &Expired, live: bool, statuses: &[(usize, Peer)], reached: &[Reached]) -> (String, Vec<String>) {
    let a = e.activity;
    let why = format!(
        "waited {:.1} s in {} (collective #{} of its group of {} ranks, where it is rank {}) for peers that never \
         arrived (raise TESSERA_TIMEOUT_S if they are only slow)",
        secs(e.waited_ms),
        a.kind,
        a.seq,
        a.size,
        a.rank
    );
    let mut details = Vec::new();
    if !statuses.is_empty() {
        if live {
            details.extend(blame_lines(&not_progressing(reached).unwrap_or_default(), reached));
            details.push(match statuses.len() {
                1 => "what the other rank of that group reports:".to_string(),
                n => format!("what the other {n} ranks of that group report:"),
            });
            details.extend(report(statuses).into_iter().map(|l| format!("  {l}")));
        } else {
            details.push("(the other ranks could not be asked: no control communicator)".to_string());
        }
    }
    (why, details)
}

/// The ranks to ask next: the members, not yet seen, of the groups that the
/// ranks reached and answered since the last call wait in (each added to
/// `reached` with the rank whose wait led to it).
fn follow_waits(
    reached: &mut Vec<(usize, Option<usize>)>,
    replies: &BTreeMap<usize, Peer>,
    followed: &mut BTreeSet<usize>,
    seen: &mut BTreeSet<usize>,
    world_size: usize,
) -> Vec<usize> {
    let mut more = Vec::new();
    let mut i = 0;
    while i < reached.len() {
        let w = reached[i].0;
        i += 1;
        let Some(p) = replies.get(&w) else { continue };
        if !followed.insert(w) {
            continue;
        }
        for &m in p.waits_on() {
            if m < world_size && seen.insert(m) {
                reached.push((m, Some(w)));
                more.push(m);
            }
        }
    }
    more
}

/// Sends `QUERY` to each of `ranks` that has not announced its exit; `false` if
/// there is no control communicator to ask over.
fn ask(ranks: &[usize], exits: &Exits) -> bool {
    let mut c = control();
    for &r in ranks.iter().filter(|r| !exits.contains_key(r)) {
        c.isend(r, TAG_QUERY, Box::new([b'?']));
    }
    c.comm().is_some()
}

/// This process finalises MPI: tells its peers (when it is worth it, see
/// [`NOTICE_ALL_UP_TO`]) and stops the watchdog's MPI calls. Idempotent; called
/// by Tessera's atexit handler before `MPI_Finalize`, and by an attribute
/// callback at the start of `MPI_Finalize` (the application's too).
pub(super) fn finalizing(exiting: bool) {
    if exiting {
        EXITING.store(true, Ordering::Relaxed);
    }
    let mut c = control();
    if c.comm().is_none() {
        c.stop();
        return;
    }
    let returned = closure_returned();
    if !returned || c.world_size <= NOTICE_ALL_UP_TO {
        let flags = u8::from(EXITING.load(Ordering::Relaxed)) * EXIT_BY_EXIT + u8::from(returned) * EXIT_AFTER_RETURN;
        // The closure's state travels in the flags.
        let (_, text) = describe(&Snapshot {
            closure_returned: false,
            ..snapshot()
        });
        let mut msg = vec![flags];
        msg.extend_from_slice(&text.as_bytes()[..text.len().min(MAX_MESSAGE - 1)]);
        let world_rank = c.world_rank;
        for dest in (0..c.world_size).filter(|&d| d != world_rank) {
            c.isend(dest, TAG_EXITING, msg.clone().into_boxed_slice());
        }
        // Small messages complete at once; a peer that is gone must not hold the exit.
        let until = Instant::now() + Duration::from_millis(100);
        while !c.pending.is_empty() && Instant::now() < until {
            c.test_pending();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    c.stop();
}

/// Calls [`finalizing`] at the start of `MPI_Finalize`, whoever calls it: MPI
/// deletes `MPI_COMM_SELF`'s attributes first thing (MPI-4.0 §11.2.4).
fn notify_at_finalize() {
    unsafe extern "C" fn no_copy(
        _: ffi::MPI_Comm,
        _: c_int,
        _: *mut c_void,
        _: *mut c_void,
        _: *mut c_void,
        flag: *mut c_int,
    ) -> c_int {
        if !flag.is_null() {
            // SAFETY: MPI passes a valid out-pointer (checked for null all the same).
            unsafe { *flag = 0 };
        }
        0
    }
    unsafe extern "C" fn on_delete(_: ffi::MPI_Comm, _: c_int, _: *mut c_void, _: *mut c_void) -> c_int {
        // A panic must not unwind into MPI.
        let _ = catch_unwind(|| finalizing(false));
        0
    }
    let mut key: c_int = 0;
    // SAFETY: MPI is initialised; both callbacks have the C signatures MPI expects,
    // and the out-pointer is valid.
    let rc = unsafe { ffi::MPI_Comm_create_keyval(Some(no_copy), Some(on_delete), &mut key, std::ptr::null_mut()) };
    if rc == 0 {
        // SAFETY: `key` was just created; the attribute value is never dereferenced.
        unsafe { ffi::MPI_Comm_set_attr(ffi::RSMPI_COMM_SELF, key, std::ptr::null_mut()) };
    }
}
