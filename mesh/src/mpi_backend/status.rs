//! What each process is doing, for the watchdog ([`super::watchdog`]), and how
//! it is worded: every communicator has a [`Watch`] (in which collective since
//! when), the process remembers the last collective it left and whether its
//! launch closure has returned; [`describe`] turns that into one line a peer's
//! abort message quotes, and [`report`] lists the peers, likeliest culprits first.
//! A reply also carries the world ranks of the groups its collectives wait in
//! ([`reply`]), so that a timed-out rank can follow who waits for whom to the
//! rank that is not progressing ([`not_progressing`]).

use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

use mpi::ffi;

use crate::OpKind;

/// Every live communicator's clock.
static WATCHED: Mutex<Vec<Weak<Watch>>> = Mutex::new(Vec::new());
/// The collective this process left last, when (ms since [`epoch`]), and its
/// group's world ranks (copied in place: no allocation per collective).
static LAST: Mutex<(Option<Left>, Vec<usize>)> = Mutex::new((None, Vec::new()));
/// A collective left, and when (ms since [`epoch`]).
type Left = (Activity, u64);
/// Whether the closure of this process's current (or last) launch has returned.
static CLOSURE_RETURNED: AtomicBool = AtomicBool::new(false);

/// A waiting collective's group members are named in its status line up to this many.
const MAX_NAMED_MEMBERS: usize = 16;
/// Peers listed one per line in the abort message; the rest are counted.
const MAX_LISTED: usize = 16;
/// `EXITING` flags: the process exits (not only finalises MPI); its closure had returned.
pub(super) const EXIT_BY_EXIT: u8 = 1;
pub(super) const EXIT_AFTER_RETURN: u8 = 2;

/// The clocks' origin (the first call).
pub(super) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    u64::try_from(epoch().elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// Milliseconds as seconds.
pub(super) fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// Records that this process's launch closure starts (`false`) or has returned (`true`).
pub(super) fn set_closure_returned(returned: bool) {
    CLOSURE_RETURNED.store(returned, Ordering::Relaxed);
}

/// Whether this process's launch closure has returned.
pub(super) fn closure_returned() -> bool {
    CLOSURE_RETURNED.load(Ordering::Relaxed)
}

/// One collective of one communicator.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Activity {
    pub(super) kind: OpKind,
    /// Its number among the communicator's collectives (from 1).
    pub(super) seq: u64,
    /// The communicator's size and this process's rank in it.
    pub(super) size: usize,
    pub(super) rank: usize,
}

impl std::fmt::Display for Activity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} #{} of a group of {} ranks, where it is rank {}",
            self.kind, self.seq, self.size, self.rank
        )
    }
}

/// Which collective a communicator is in, and since when (for the watchdog).
pub(crate) struct Watch {
    /// Milliseconds since `epoch()` plus one when the collective began; 0 when idle.
    since: AtomicU64,
    kind: AtomicUsize,
    seq: AtomicU64,
    /// Set by the fingerprint check's traffic ([`enter_check`](Self::enter_check)),
    /// which already numbered the collective it checks: that collective's own
    /// [`enter`](Self::enter) then does not count again.
    counted: AtomicBool,
    rank: usize,
    size: usize,
    /// The members' world ranks, in the communicator's rank order (empty: unknown).
    members: Vec<usize>,
}

impl Watch {
    /// A registered clock for `comm`, of `size` ranks, in which this process is `rank`.
    pub(crate) fn new(comm: ffi::MPI_Comm, rank: usize, size: usize) -> Arc<Watch> {
        let w = Arc::new(Watch {
            since: AtomicU64::new(0),
            kind: AtomicUsize::new(0),
            seq: AtomicU64::new(0),
            counted: AtomicBool::new(false),
            rank,
            size,
            members: world_ranks(comm, size),
        });
        if let Ok(mut all) = WATCHED.lock() {
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&w));
        }
        w
    }

    /// Starts the clock of one collective; it stops when the guard drops.
    pub(crate) fn enter(&self, kind: OpKind) -> WatchGuard<'_> {
        let counted = self.counted.swap(false, Ordering::Relaxed);
        self.start(kind, !counted)
    }

    /// Starts the clock for the fingerprint check of the collective `kind` about
    /// to be issued: the check's traffic counts as that collective (numbered
    /// once, however many calls the check makes), so that reports number the
    /// collectives the caller issued.
    pub(crate) fn enter_check(&self, kind: OpKind) -> WatchGuard<'_> {
        let counted = self.counted.swap(true, Ordering::Relaxed);
        self.start(kind, !counted)
    }

    fn start(&self, kind: OpKind, count: bool) -> WatchGuard<'_> {
        let i = OpKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        self.kind.store(i, Ordering::Relaxed);
        if count {
            self.seq.fetch_add(1, Ordering::Relaxed);
        }
        self.since.store(now_ms() + 1, Ordering::Release);
        WatchGuard(self)
    }

    fn activity(&self) -> Activity {
        Activity {
            kind: OpKind::ALL[self.kind.load(Ordering::Relaxed).min(OpKind::ALL.len() - 1)],
            seq: self.seq.load(Ordering::Relaxed),
            size: self.size,
            rank: self.rank,
        }
    }
}

/// Stops a [`Watch`]'s clock on drop.
pub(crate) struct WatchGuard<'a>(&'a Watch);

impl Drop for WatchGuard<'_> {
    fn drop(&mut self) {
        self.0.since.store(0, Ordering::Release);
        if let Ok(mut last) = LAST.lock() {
            last.0 = Some((self.0.activity(), now_ms()));
            if last.1 != self.0.members {
                last.1.clear();
                last.1.extend_from_slice(&self.0.members);
            }
        }
    }
}

/// The world ranks of `comm`'s members, in its rank order; empty if MPI cannot say.
fn world_ranks(comm: ffi::MPI_Comm, size: usize) -> Vec<usize> {
    let Ok(n) = c_int::try_from(size) else {
        return Vec::new();
    };
    // SAFETY: reading a predefined handle after MPI_Init.
    let (mut group, mut world) = unsafe { (ffi::RSMPI_GROUP_NULL, ffi::RSMPI_GROUP_NULL) };
    // SAFETY: `comm` is a live communicator; the out-pointer is valid.
    if unsafe { ffi::MPI_Comm_group(comm, &mut group) } != 0 {
        return Vec::new();
    }
    let ranks: Vec<c_int> = (0..n).collect();
    let mut out: Vec<c_int> = vec![-1; size];
    // SAFETY: the out-pointer is valid.
    let mut rc = unsafe { ffi::MPI_Comm_group(ffi::RSMPI_COMM_WORLD, &mut world) };
    if rc == 0 {
        // SAFETY: both groups are live; `ranks` and `out` hold `n` ints each.
        rc = unsafe { ffi::MPI_Group_translate_ranks(group, n, ranks.as_ptr(), world, out.as_mut_ptr()) };
        // SAFETY: `world` was created above and is not used after this.
        unsafe { ffi::MPI_Group_free(&mut world) };
    }
    // SAFETY: `group` was created above and is not used after this.
    unsafe { ffi::MPI_Group_free(&mut group) };
    if rc != 0 {
        return Vec::new();
    }
    // MPI_UNDEFINED (negative) for a member outside the world: unknown.
    out.iter()
        .map(|&r| usize::try_from(r).ok())
        .collect::<Option<Vec<_>>>()
        .unwrap_or_default()
}

/// What this process is doing, as a status class and one line (in the third person).
#[derive(Clone, Debug, Default)]
pub(super) struct Snapshot {
    /// Collectives in progress, how long each has waited (ms), and the world
    /// ranks of its group (empty: unknown).
    pub(super) waiting: Vec<(Activity, u64, Vec<usize>)>,
    /// The last collective left and how long ago (ms).
    /// With its group's world ranks (empty: unknown).
    pub(super) last: Option<(Activity, u64, Vec<usize>)>,
    pub(super) closure_returned: bool,
}

/// A status's class, sent as its first byte; higher ones are listed first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Class {
    Waiting = 0,
    Outside = 1,
    Returned = 2,
}

impl Class {
    fn from_byte(b: u8) -> Class {
        match b {
            0 => Class::Waiting,
            2 => Class::Returned,
            _ => Class::Outside,
        }
    }
}

/// What this process is doing now.
pub(super) fn snapshot() -> Snapshot {
    let now = now_ms();
    let live: Vec<Arc<Watch>> = WATCHED
        .lock()
        .map(|all| all.iter().filter_map(Weak::upgrade).collect())
        .unwrap_or_default();
    let waiting = live
        .iter()
        .filter_map(|w| {
            let since = w.since.load(Ordering::Acquire);
            (since != 0).then(|| (w.activity(), now.saturating_sub(since - 1), w.members.clone()))
        })
        .collect();
    let last = LAST
        .lock()
        .ok()
        .and_then(|l| l.0.map(|(a, at)| (a, now.saturating_sub(at), l.1.clone())));
    Snapshot {
        waiting,
        last,
        closure_returned: CLOSURE_RETURNED.load(Ordering::Relaxed),
    }
}

/// " (world ranks [0, 1])", for a group small enough to read at a glance.
fn named(members: &[usize]) -> String {
    if members.is_empty() || members.len() > MAX_NAMED_MEMBERS {
        String::new()
    } else {
        format!(" (world ranks {members:?})")
    }
}

/// The status class and line (in the third person) of `s`.
pub(super) fn describe(s: &Snapshot) -> (Class, String) {
    let returned = if s.closure_returned {
        "its closure has returned; "
    } else {
        ""
    };
    if !s.waiting.is_empty() {
        let each: Vec<String> = s
            .waiting
            .iter()
            .map(|(a, ms, members)| format!("waiting {:.1} s in {a}{}", secs(*ms), named(members)))
            .collect();
        return (Class::Waiting, format!("{returned}{}", each.join("; and ")));
    }
    let outside = match &s.last {
        Some((a, ms, members)) => format!(
            "outside any collective for {:.1} s (last: {a}{})",
            secs(*ms),
            named(members)
        ),
        None => "outside any collective (it has not entered one yet)".to_string(),
    };
    let class = if s.closure_returned {
        Class::Returned
    } else {
        Class::Outside
    };
    (class, format!("{returned}{outside}"))
}

/// The longest list of group members a reply carries (bytes); a longer one is cut
/// at a whole rank (the walk then reaches fewer ranks).
const MAX_GROUPS_TEXT: usize = 2048;

/// The `REPLY` to a query, `max` bytes at most: the class byte, the status line,
/// then (after a NUL) the world ranks of the groups of the collectives it waits
/// in, comma-separated.
pub(super) fn reply(s: &Snapshot, max: usize) -> Vec<u8> {
    let (class, text) = describe(s);
    let mut ranks: Vec<usize> = s.waiting.iter().flat_map(|(_, _, m)| m.iter().copied()).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut groups = String::new();
    for r in ranks {
        let item = if groups.is_empty() {
            r.to_string()
        } else {
            format!(",{r}")
        };
        if groups.len() + item.len() > MAX_GROUPS_TEXT.min(max / 2) {
            break;
        }
        groups.push_str(&item);
    }
    let room = max.saturating_sub(2 + groups.len());
    let mut cut = text.len().min(room);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut msg = vec![class as u8];
    msg.extend_from_slice(&text.as_bytes()[..cut]);
    if !groups.is_empty() {
        msg.push(0);
        msg.extend_from_slice(groups.as_bytes());
    }
    msg
}

/// What the timed-out rank learnt about one peer.
#[derive(Clone, Debug)]
pub(super) enum Peer {
    /// A `REPLY`: its class, status line, and the world ranks of the groups it waits in.
    Replied(Class, String, Vec<usize>),
    /// Its `EXITING` notice: flags and its status then.
    Exited(u8, String),
    Silent,
}

impl Peer {
    /// A `REPLY` ([`reply`]): class byte, the status line, then the groups' ranks.
    pub(super) fn from_reply(body: &[u8]) -> Peer {
        let (class, rest) = body
            .split_first()
            .map_or((Class::Outside, &[][..]), |(c, t)| (Class::from_byte(*c), t));
        let (text, groups) = match rest.iter().position(|&b| b == 0) {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &[][..]),
        };
        let groups = String::from_utf8_lossy(groups)
            .split(',')
            .filter_map(|r| r.parse().ok())
            .collect();
        Peer::Replied(class, String::from_utf8_lossy(text).into_owned(), groups)
    }

    /// The world ranks of the groups a peer waits in (empty unless it waits).
    pub(super) fn waits_on(&self) -> &[usize] {
        match self {
            Peer::Replied(Class::Waiting, _, groups) => groups,
            _ => &[],
        }
    }

    /// An `EXITING` notice: flags byte, then the status line.
    pub(super) fn from_exit(body: &[u8]) -> Peer {
        let (flags, text) = body.split_first().map_or((0, &[][..]), |(f, t)| (*f, t));
        Peer::Exited(flags, String::from_utf8_lossy(text).into_owned())
    }

    /// The order of the abort message: the likeliest culprits first.
    fn priority(&self) -> u8 {
        match self {
            Peer::Exited(..) => 5,
            Peer::Silent => 4,
            Peer::Replied(c, ..) => *c as u8 + 1,
        }
    }

    fn line(&self, rank: usize) -> String {
        match self {
            Peer::Replied(_, text, _) => format!("rank {rank}: {text}"),
            Peer::Silent => format!("rank {rank} did not answer (it exited, or is not responding)"),
            Peer::Exited(flags, text) => {
                let how = if flags & EXIT_BY_EXIT != 0 {
                    "exited (its process called exit)"
                } else {
                    "finalized MPI (its application called MPI_Finalize)"
                };
                let when = if flags & EXIT_AFTER_RETURN != 0 {
                    "after its closure returned"
                } else {
                    "before its closure returned"
                };
                format!("rank {rank} {how} while this rank waited for it, {when}; it was {text}")
            }
        }
    }
}

/// One line per peer, likeliest culprits first, at most [`MAX_LISTED`], then a count.
pub(super) fn report(peers: &[(usize, Peer)]) -> Vec<String> {
    let mut order: Vec<&(usize, Peer)> = peers.iter().collect();
    order.sort_by_key(|(rank, p)| (std::cmp::Reverse(p.priority()), *rank));
    let mut lines: Vec<String> = order.iter().take(MAX_LISTED).map(|(r, p)| p.line(*r)).collect();
    let rest = &order[order.len().min(MAX_LISTED)..];
    if !rest.is_empty() {
        let waiting = rest
            .iter()
            .filter(|(_, p)| matches!(p, Peer::Replied(Class::Waiting, ..)))
            .count();
        lines.push(format!(
            "and {} more ranks ({waiting} of them waiting in collectives)",
            rest.len()
        ));
    }
    lines
}

/// One rank a timed-out rank reached while following who waits for whom: the
/// rank, the rank whose wait led to it (`None`: a member of the timed-out
/// collective's group), and what it reported.
pub(super) type Reached = (usize, Option<usize>, Peer);

/// The rank not progressing among those reached (listed in the order they were
/// reached), and the chain of ranks from the timed-out group's member to it: the
/// nearest rank that does not wait in a collective (it is outside any, has
/// returned or exited, or did not answer), likeliest culprits first among equally
/// near ones. `None` if every rank reached waits.
pub(super) fn not_progressing(reached: &[Reached]) -> Option<Vec<usize>> {
    let parent = |r: usize| reached.iter().find(|(q, ..)| *q == r).and_then(|e| e.1);
    // From the timed-out group's member to `r`.
    let path = |r: usize| {
        let mut p = vec![r];
        let mut at = parent(r);
        while let Some(w) = at.filter(|w| !p.contains(w)) {
            p.push(w);
            at = parent(w);
        }
        p.reverse();
        p
    };
    reached
        .iter()
        .enumerate()
        .filter(|(_, (_, _, p))| !matches!(p, Peer::Replied(Class::Waiting, ..)))
        .min_by_key(|(i, (r, _, p))| (path(*r).len(), std::cmp::Reverse(p.priority()), *i))
        .map(|(_, (r, ..))| path(*r))
}

/// The abort message's lines naming the rank not progressing and the waits that
/// lead to it (`chain` from [`not_progressing`]).
pub(super) fn blame_lines(chain: &[usize], reached: &[Reached]) -> Vec<String> {
    let Some(&blamed) = chain.last() else {
        return vec!["every rank reached waits in a collective (ranks waiting for each other?)".to_string()];
    };
    let mut lines = vec![if chain.len() == 1 {
        format!("the rank not progressing is rank {blamed}:")
    } else {
        format!("the rank not progressing is rank {blamed}; the waits that lead to it:")
    }];
    for &r in chain {
        if let Some((_, _, p)) = reached.iter().find(|(q, ..)| *q == r) {
            lines.push(format!("  {}", p.line(r)));
        }
    }
    lines
}

/// A collective that waited longer than the timeout.
pub(super) struct Expired {
    pub(super) activity: Activity,
    pub(super) waited_ms: u64,
    /// The group's world ranks (empty: unknown).
    pub(super) members: Vec<usize>,
}

/// The first collective of this process that has waited longer than `timeout_ms`.
pub(super) fn expired(timeout_ms: u64) -> Option<Expired> {
    let now = now_ms();
    let all = WATCHED.lock().ok()?;
    all.iter().filter_map(Weak::upgrade).find_map(|w| {
        let since = w.since.load(Ordering::Acquire);
        let waited_ms = now.saturating_sub(since.saturating_sub(1));
        (since != 0 && waited_ms > timeout_ms).then(|| Expired {
            activity: w.activity(),
            waited_ms,
            members: w.members.clone(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn act(kind: OpKind, seq: u64) -> Activity {
        Activity {
            kind,
            seq,
            size: 2,
            rank: 1,
        }
    }

    #[test]
    fn statuses_read_as_one_line() {
        macro_rules! case {
            ($waiting:expr, $last:expr, $returned:expr => $class:expr, $text:expr) => {
                let s = Snapshot {
                    waiting: $waiting,
                    last: $last,
                    closure_returned: $returned,
                };
                assert_eq!(describe(&s), ($class, $text.to_string()));
            };
        }
        let ar = act(OpKind::AllReduce, 5);
        let b = act(OpKind::Barrier, 2);
        case!(vec![], None, false => Class::Outside, "outside any collective (it has not entered one yet)");
        case!(vec![], Some((b, 3200, vec![])), false => Class::Outside,
            "outside any collective for 3.2 s (last: barrier #2 of a group of 2 ranks, where it is rank 1)");
        case!(vec![], Some((b, 3200, vec![2, 5])), false => Class::Outside,
            "outside any collective for 3.2 s (last: barrier #2 of a group of 2 ranks, where it is rank 1 \
             (world ranks [2, 5]))");
        case!(vec![(ar, 3100, vec![])], Some((b, 9, vec![])), false => Class::Waiting,
            "waiting 3.1 s in all_reduce #5 of a group of 2 ranks, where it is rank 1");
        case!(vec![(ar, 3100, vec![0, 3])], None, false => Class::Waiting,
            "waiting 3.1 s in all_reduce #5 of a group of 2 ranks, where it is rank 1 (world ranks [0, 3])");
        case!(vec![], Some((b, 400, vec![])), true => Class::Returned,
            "its closure has returned; outside any collective for 0.4 s (last: barrier #2 of a group of 2 ranks, \
             where it is rank 1)");
    }

    #[test]
    fn peers_are_named_likeliest_culprits_first() {
        macro_rules! line {
            ($rank:expr, $peer:expr => $text:expr) => {
                assert_eq!($peer.line($rank), $text);
            };
        }
        let exit = Peer::from_exit(b"\x01outside any collective for 0.0 s (last: x)");
        line!(1, exit => "rank 1 exited (its process called exit) while this rank waited for it, before its \
            closure returned; it was outside any collective for 0.0 s (last: x)");
        line!(2, Peer::from_exit(b"\x02y") => "rank 2 finalized MPI (its application called MPI_Finalize) while \
            this rank waited for it, after its closure returned; it was y");
        line!(3, Peer::Silent => "rank 3 did not answer (it exited, or is not responding)");
        line!(4, Peer::from_reply(b"\x00waiting 1.0 s in barrier #1") => "rank 4: waiting 1.0 s in barrier #1");
        line!(5, Peer::from_reply(b"") => "rank 5: ");

        let waiting = || Peer::Replied(Class::Waiting, "w".into(), vec![]);
        let mut peers: Vec<(usize, Peer)> = (1..=20).map(|r| (r, waiting())).collect();
        peers[17].1 = Peer::Replied(Class::Outside, "stalled".into(), vec![]);
        peers[18].1 = Peer::Silent;
        let lines = report(&peers);
        assert_eq!(lines.len(), MAX_LISTED + 1, "{lines:?}");
        assert!(lines[0].starts_with("rank 19 did not answer"), "{lines:?}");
        assert_eq!(lines[1], "rank 18: stalled");
        assert_eq!(lines[MAX_LISTED], "and 4 more ranks (4 of them waiting in collectives)");
    }

    #[test]
    fn a_reply_carries_the_groups_it_waits_in() {
        let s = Snapshot {
            waiting: vec![
                (act(OpKind::AllGather, 3), 2900, vec![0, 1]),
                (act(OpKind::Barrier, 1), 10, vec![1, 3]),
            ],
            last: None,
            closure_returned: false,
        };
        let body = reply(&s, 4096);
        match Peer::from_reply(&body) {
            Peer::Replied(Class::Waiting, text, groups) => {
                assert_eq!(groups, [0, 1, 3]);
                assert!(text.starts_with("waiting 2.9 s in all_gather #3"), "{text}");
                assert!(text.contains("(world ranks [1, 3])"), "{text}");
            }
            other => panic!("{other:?}"),
        }
        // Cut to fit: the groups survive whole, the text is shortened.
        let short = reply(&s, 40);
        assert!(short.len() <= 40, "{}", short.len());
        assert_eq!(Peer::from_reply(&short).waits_on(), [0, 1, 3]);
        // A rank outside any collective waits on nobody.
        let idle = reply(&Snapshot::default(), 4096);
        assert!(Peer::from_reply(&idle).waits_on().is_empty());
    }

    #[test]
    fn the_nearest_rank_in_no_collective_is_blamed() {
        let w = |groups: &[usize]| Peer::Replied(Class::Waiting, "w".into(), groups.to_vec());
        let out = || Peer::Replied(Class::Outside, "o".into(), vec![]);
        macro_rules! case {
            ($reached:expr => $want:expr) => {
                let reached: Vec<Reached> = $reached;
                assert_eq!(not_progressing(&reached), $want, "{reached:?}");
            };
        }
        // Rank 3 timed out on rank 1, which waits with rank 0, which is outside.
        case!(vec![(1, None, w(&[0, 1])), (0, Some(1), out())] => Some(vec![1, 0]));
        // A member of the timed-out group outside any collective is nearer.
        case!(vec![(1, None, w(&[0, 1])), (2, None, out()), (0, Some(1), out())] => Some(vec![2]));
        // Equally near: a rank that did not answer before one outside.
        case!(vec![(1, None, out()), (2, None, Peer::Silent)] => Some(vec![2]));
        // Two hops.
        case!(vec![(1, None, w(&[1, 5])), (5, Some(1), w(&[4, 5])), (4, Some(5), out())] => Some(vec![1, 5, 4]));
        // Everyone waits.
        case!(vec![(1, None, w(&[0, 1])), (0, Some(1), w(&[0, 1]))] => None);
        let reached = vec![(1, None, w(&[0, 1])), (0, Some(1), out())];
        assert_eq!(
            blame_lines(&[1, 0], &reached),
            [
                "the rank not progressing is rank 0; the waits that lead to it:",
                "  rank 1: w",
                "  rank 0: o"
            ]
        );
    }
}
