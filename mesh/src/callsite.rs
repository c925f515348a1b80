//! Where each collective was issued: the user's line, carried in every
//! collective's fingerprint so that ranks whose sequences diverge are told where.
//!
//! Every [`Communicator`](crate::Communicator) method is `#[track_caller]` (also
//! through `dyn Communicator`), so a backend knows the line that called it. That
//! line is often inside the library (a redistribute's `all_gather`); the line that
//! helps is the user's. So a public entry point that issues collectives
//! (`DTensor::redistribute`, `clip_grad_norm`, `Var::backward`, FSDP's hooks, ...)
//! is `#[track_caller]` too and opens a scope with [`enter`]: the outermost open
//! scope of a thread wins, and every collective issued inside it records the
//! scope's location as its [`CallSite::site`] (and its own direct call as
//! [`CallSite::direct`], shown beside it when they differ).
//!
//! An entry point may also fold a *tag* into its scope ([`Guard::tag`]): a hash
//! of what the collectives are about (the parameters' names and shapes for
//! `clip_grad_norm`, the global shape and placements for a redistribute). Ranks
//! whose tags differ are running the same collective for different things; the
//! backends report that as a mismatch whenever both ranks set a tag. Call sites
//! themselves are compared only in strict mode
//! ([`LaunchOptions::strict_collectives`](crate::LaunchOptions::strict_collectives)).
//!
//! ```
//! use tessera_mesh::callsite;
//!
//! #[track_caller]
//! fn my_entry_point() -> callsite::CallSite {
//!     let _site = callsite::enter().tag(callsite::tag_of(&("my_entry_point", [4, 8])));
//!     callsite::here() // what a collective issued here records
//! }
//! let line = line!() + 1;
//! let site = my_entry_point();
//! assert_eq!(site.site.line(), line);
//! assert_ne!(site.tag, 0);
//! ```

use std::cell::Cell;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::panic::Location;

/// Where a collective was issued, and what about.
#[derive(Clone, Copy, Debug)]
pub struct CallSite {
    /// The location of the outermost open scope ([`enter`]), or of the direct
    /// call when no scope is open: the user's line.
    pub site: &'static Location<'static>,
    /// The location of the direct call of the communicator method.
    pub direct: &'static Location<'static>,
    /// The tag words folded into the open scopes ([`Guard::tag`]); 0 when none.
    pub tag: u64,
}

impl CallSite {
    /// Whether `self` and `other` name the same source location (the sites;
    /// direct calls are only for display).
    pub fn same_site(&self, other: &CallSite) -> bool {
        same_location(self.site, other.site)
    }

    /// Whether the tags conflict: both set and different.
    pub fn tags_conflict(&self, other: &CallSite) -> bool {
        self.tag != 0 && other.tag != 0 && self.tag != other.tag
    }

    /// A 64-bit hash of the site's file, line and column, equal in every process
    /// of one build (what the MPI backend sends instead of the strings).
    pub fn site_hash(&self) -> u64 {
        let mut h = StableHasher::default();
        (self.site.file(), self.site.line(), self.site.column()).hash(&mut h);
        h.finish()
    }
}

/// Whether two locations name the same file, line and column.
pub fn same_location(a: &Location<'_>, b: &Location<'_>) -> bool {
    std::ptr::eq(a, b) || (a.line() == b.line() && a.column() == b.column() && a.file() == b.file())
}

impl fmt::Display for CallSite {
    /// `file:line:col`, with ` (via file:line:col)` when the direct call is elsewhere.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.site)?;
        if !same_location(self.site, self.direct) {
            write!(f, " (via {})", self.direct)?;
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
struct Scope {
    at: &'static Location<'static>,
    tag: u64,
}

thread_local! {
    static SCOPE: Cell<Option<Scope>> = const { Cell::new(None) };
    static ISSUING: Cell<Option<CallSite>> = const { Cell::new(None) };
}

/// An open scope; dropping it restores the scope state it found (guards must be
/// dropped in reverse order of creation, as `let` bindings are).
#[must_use = "the scope closes when the guard is dropped"]
pub struct Guard {
    prev: Option<Scope>,
    /// Scopes are per thread.
    _thread: PhantomData<*const ()>,
}

impl Guard {
    /// Folds `word` (a hash of what this entry point's collectives are about;
    /// see [`tag_of`]) into the open scope's tag until this guard drops.
    pub fn tag(self, word: u64) -> Guard {
        SCOPE.with(|s| {
            if let Some(mut scope) = s.get() {
                scope.tag = fold(scope.tag, word);
                s.set(Some(scope));
            }
        });
        self
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        SCOPE.with(|s| s.set(self.prev));
    }
}

/// Opens a call-site scope at the caller's location (put `#[track_caller]` on
/// the entry point calling it, so that the location is its caller's), unless
/// one is open already: the outermost scope wins.
#[track_caller]
pub fn enter() -> Guard {
    enter_at(Location::caller())
}

/// [`enter`] at a given location.
pub fn enter_at(at: &'static Location<'static>) -> Guard {
    let prev = SCOPE.with(|s| {
        let prev = s.get();
        if prev.is_none() {
            s.set(Some(Scope { at, tag: 0 }));
        }
        prev
    });
    Guard {
        prev,
        _thread: PhantomData,
    }
}

/// The call site a collective issued here records: the open scope's location
/// and tag, and the caller's location as the direct call.
#[track_caller]
pub fn here() -> CallSite {
    let direct = Location::caller();
    match SCOPE.with(Cell::get) {
        Some(s) => CallSite {
            site: s.at,
            direct,
            tag: s.tag,
        },
        None => CallSite {
            site: direct,
            direct,
            tag: 0,
        },
    }
}

/// A tag word for [`Guard::tag`]: a hash of `what`, the same in every process
/// of one build.
pub fn tag_of<T: Hash + ?Sized>(what: &T) -> u64 {
    let mut h = StableHasher::default();
    what.hash(&mut h);
    h.finish() | 1
}

fn fold(tag: u64, word: u64) -> u64 {
    // Never 0 (0 means "no tag").
    (tag.rotate_left(5) ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1
}

/// FNV-1a over the hashed bytes: deterministic across processes and runs.
struct StableHasher(u64);

impl Default for StableHasher {
    fn default() -> Self {
        StableHasher(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// The call site a backend is issuing a collective for on this thread: set by
/// the communicator method ([`issue`]) or, for an asynchronous collective, by
/// the communication thread with the site captured when it was issued.
pub(crate) fn issuing() -> Option<CallSite> {
    ISSUING.with(Cell::get)
}

/// Marks `site` as the collective being issued on this thread until the guard drops.
pub(crate) fn issue_at(site: CallSite) -> Issuing {
    Issuing(ISSUING.with(|s| s.replace(Some(site))))
}

/// [`issue_at`] the caller's [`here`].
#[track_caller]
pub(crate) fn issue() -> Issuing {
    issue_at(here())
}

/// Restores the previous issuing site when dropped.
pub(crate) struct Issuing(Option<CallSite>);

impl Drop for Issuing {
    fn drop(&mut self) {
        let prev = self.0;
        ISSUING.with(|s| s.set(prev));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn entry(word: u64) -> CallSite {
        let _s = enter().tag(word);
        inner()
    }

    fn inner() -> CallSite {
        let _s = enter().tag(7);
        here()
    }

    #[test]
    fn outermost_scope_wins_and_guards_restore() {
        let line = line!() + 1;
        let s = entry(3);
        assert_eq!((s.site.line(), s.site.file()), (line, file!()));
        assert_ne!(s.direct.line(), line, "the direct call is inside `inner`");
        assert_ne!(s.tag, 0);
        assert_ne!(entry(4).tag, s.tag, "tags fold every scope's word");
        assert_eq!(entry(3).tag, s.tag);
        // Every guard dropped: no scope left.
        let free = here();
        assert!(free.same_site(&free) && free.tag == 0 && same_location(free.site, free.direct));
        assert!(!free.tags_conflict(&s) && s.tags_conflict(&entry(4)));
        assert!(format!("{s}").contains(" (via "), "{s}");
    }

    #[test]
    fn issuing_nests() {
        assert!(issuing().is_none());
        let a = issue();
        let line = issuing().map(|s| s.site.line());
        {
            let _b = issue_at(entry(1));
            assert_ne!(issuing().map(|s| s.site.line()), line);
        }
        assert_eq!(issuing().map(|s| s.site.line()), line);
        drop(a);
        assert!(issuing().is_none());
    }
}
