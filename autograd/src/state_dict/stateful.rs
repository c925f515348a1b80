//! Training state that is not a tensor — the step, the data position, the
//! learning-rate schedule, a random generator, a user's own counters — saved
//! in a checkpoint beside the tensors and restored from it.
//!
//! ```
//! use std::collections::BTreeMap;
//! use tessera_autograd::state_dict::{Progress, Stateful, load_states, states_to_metadata};
//! use tessera_tensor::rng::Rng;
//!
//! let (progress, mut rng) = (Progress { step: 120, position: 960 }, Rng::new(7));
//! rng.next_u64();
//! // Saved as checkpoint metadata ("progress.step", "rng.s0", ...).
//! let meta = states_to_metadata(&[("progress", &progress), ("rng", &rng)]).unwrap();
//!
//! let (mut p, mut r) = (Progress::default(), Rng::new(0));
//! load_states(&meta, &mut [("progress", &mut p), ("rng", &mut r)]).unwrap();
//! assert_eq!(p, progress);
//! assert_eq!(r.next_u64(), rng.next_u64());
//! ```

use std::collections::BTreeMap;

use tessera_tensor::rng::Rng;

use crate::{Error, Result};

const OP: &str = "stateful";

/// An object whose state a checkpoint saves as named string values and
/// restores: `state_dict` on save, `load_state_dict` on load.
///
/// PyTorch: `torch.distributed.checkpoint.stateful.Stateful`, whose
/// `state_dict`/`load_state_dict` `dcp.save` and `dcp.load` call for the
/// non-tensor entries of the state they are given.
pub trait Stateful {
    /// The state, as values by key (keys without dots are the plainest; any
    /// string is kept as it is).
    fn state_dict(&self) -> BTreeMap<String, String>;

    /// Restores the state [`state_dict`](Self::state_dict) gave.
    ///
    /// # Errors
    /// A missing key or a value this object cannot take, naming the key.
    fn load_state_dict(&mut self, state: &BTreeMap<String, String>) -> Result<()>;
}

/// Where a run is: the steps taken and the position of its data (samples,
/// rows or batches consumed, as the reader counts them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Optimizer steps taken.
    pub step: u64,
    /// The data reader's position.
    pub position: u64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("step".to_string(), self.step.to_string()),
            ("position".to_string(), self.position.to_string()),
        ])
    }

    fn load_state_dict(&mut self, state: &BTreeMap<String, String>) -> Result<()> {
        let (step, position) = (parsed(state, "step")?, parsed(state, "position")?);
        (self.step, self.position) = (step, position);
        Ok(())
    }
}

/// A host random generator: its four words of state and the normal it holds
/// back, so that a restored generator continues the same sequence.
impl Stateful for Rng {
    fn state_dict(&self) -> BTreeMap<String, String> {
        let (s, spare) = self.state();
        let mut m: BTreeMap<String, String> = s
            .iter()
            .enumerate()
            .map(|(i, w)| (format!("s{i}"), w.to_string()))
            .collect();
        // Bits, so that the value comes back exactly.
        m.insert(
            "spare_normal".to_string(),
            spare.map_or_else(|| "none".to_string(), |z| z.to_bits().to_string()),
        );
        m
    }

    fn load_state_dict(&mut self, state: &BTreeMap<String, String>) -> Result<()> {
        let s = [
            parsed(state, "s0")?,
            parsed(state, "s1")?,
            parsed(state, "s2")?,
            parsed(state, "s3")?,
        ];
        let spare = match entry(state, "spare_normal")? {
            "none" => None,
            _ => Some(f64::from_bits(parsed(state, "spare_normal")?)),
        };
        *self = Rng::from_state(s, spare).map_err(|detail| Error::Config { op: OP, detail })?;
        Ok(())
    }
}

/// A user's own values, saved and restored as they are.
impl Stateful for BTreeMap<String, String> {
    fn state_dict(&self) -> BTreeMap<String, String> {
        self.clone()
    }

    fn load_state_dict(&mut self, state: &BTreeMap<String, String>) -> Result<()> {
        self.clone_from(state);
        Ok(())
    }
}

/// The value of `key`, or an error naming the key.
fn entry<'a>(state: &'a BTreeMap<String, String>, key: &str) -> Result<&'a str> {
    state.get(key).map(String::as_str).ok_or_else(|| Error::Config {
        op: OP,
        detail: format!(
            "no {key} in the saved state (keys: {:?})",
            state.keys().collect::<Vec<_>>()
        ),
    })
}

/// The value of `key` parsed, or an error naming the key and the value.
pub(crate) fn parsed<T: std::str::FromStr>(state: &BTreeMap<String, String>, key: &str) -> Result<T> {
    let v = entry(state, key)?;
    v.parse().map_err(|_| Error::Config {
        op: OP,
        detail: format!("{key} is {v:?}, not a {}", std::any::type_name::<T>()),
    })
}

/// Checkpoint metadata holding the state of each named object: entry `key`
/// of `name`'s state as `name.key` (PyTorch: the non-tensor entries of the
/// state dict given to `dcp.save`, by their keys). Merge it into the metadata
/// given to [`save_checkpoint`](crate::save_checkpoint).
///
/// # Errors
/// A name that is empty, holds a dot, or comes twice.
pub fn states_to_metadata(states: &[(&str, &dyn Stateful)]) -> Result<BTreeMap<String, String>> {
    check_names(states.iter().map(|(n, _)| *n))?;
    Ok(states
        .iter()
        .flat_map(|(name, s)| s.state_dict().into_iter().map(move |(k, v)| (format!("{name}.{k}"), v)))
        .collect())
}

/// Restores each named object from the entries `name.*` of a checkpoint's
/// `metadata` (as [`states_to_metadata`] wrote them). Every object's entries
/// are found before any is loaded; objects then load in order.
///
/// # Errors
/// A name as [`states_to_metadata`] refuses, a name with no entries (the
/// checkpoint was saved without it), or an object's own error, naming it.
pub fn load_states(metadata: &BTreeMap<String, String>, states: &mut [(&str, &mut dyn Stateful)]) -> Result<()> {
    check_names(states.iter().map(|(n, _)| *n))?;
    let picked: Vec<BTreeMap<String, String>> = states
        .iter()
        .map(|(name, _)| {
            let prefix = format!("{name}.");
            let mine: BTreeMap<String, String> = metadata
                .iter()
                .filter_map(|(k, v)| k.strip_prefix(&prefix).map(|k| (k.to_string(), v.clone())))
                .collect();
            if mine.is_empty() {
                return Err(Error::Config {
                    op: OP,
                    detail: format!("the checkpoint holds no state of {name} (saved without it?)"),
                });
            }
            Ok(mine)
        })
        .collect::<Result<_>>()?;
    for ((name, s), state) in states.iter_mut().zip(&picked) {
        s.load_state_dict(state).map_err(|e| match e {
            Error::Config { detail, .. } => Error::Config {
                op: OP,
                detail: format!("{name}: {detail}"),
            },
            other => other,
        })?;
    }
    Ok(())
}

/// Errors unless every name is non-empty, dot-free and given once.
fn check_names<'a>(names: impl Iterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::BTreeSet::new();
    for n in names {
        if n.is_empty() || n.contains('.') || !seen.insert(n) {
            return Err(Error::Config {
                op: OP,
                detail: format!(
                    "state name {n:?} is empty, holds a dot or comes twice; give each object its own plain name"
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restored_generator_continues_the_sequence_normals_included() {
        let mut a = Rng::new(11);
        a.normal(); // holds the pair's second normal back
        let meta = states_to_metadata(&[("rng", &a)]).unwrap();
        let mut b = Rng::new(0);
        load_states(&meta, &mut [("rng", &mut b)]).unwrap();
        assert_eq!(a.normal().to_bits(), b.normal().to_bits());
        assert_eq!(
            (0..5).map(|_| a.next_u64()).collect::<Vec<_>>(),
            (0..5).map(|_| b.next_u64()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn progress_and_user_state_round_trip_under_their_names() {
        let p = Progress { step: 3, position: 48 };
        let user = BTreeMap::from([("epoch".to_string(), "2".to_string())]);
        let meta = states_to_metadata(&[("progress", &p), ("mine", &user)]).unwrap();
        assert_eq!(meta["progress.step"], "3");
        assert_eq!(meta["mine.epoch"], "2");
        let (mut q, mut u) = (Progress::default(), BTreeMap::new());
        load_states(&meta, &mut [("progress", &mut q), ("mine", &mut u)]).unwrap();
        assert_eq!((q, u), (p, user));
    }

    #[test]
    fn missing_or_bad_state_is_an_error_naming_it_and_nothing_loads() {
        let meta = states_to_metadata(&[("progress", &Progress { step: 3, position: 1 })]).unwrap();
        let (mut p, mut r) = (Progress::default(), Rng::new(1));
        let e = load_states(&meta, &mut [("progress", &mut p), ("rng", &mut r)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no state of rng"), "{e}");
        assert_eq!(p, Progress::default(), "progress loaded although rng was missing");
        let mut bad = meta.clone();
        bad.insert("progress.step".into(), "three".into());
        let e = load_states(&bad, &mut [("progress", &mut p)]).unwrap_err().to_string();
        assert!(e.contains("progress: step is \"three\""), "{e}");
        for names in [&["a", "a"][..], &["a.b"], &[""]] {
            let states: Vec<(&str, &dyn Stateful)> = names.iter().map(|n| (*n, &p as &dyn Stateful)).collect();
            assert!(states_to_metadata(&states).is_err(), "{names:?}");
        }
        let zero = BTreeMap::from(["s0", "s1", "s2", "s3"].map(|k| (format!("rng.{k}"), "0".to_string())));
        let mut zero = zero;
        zero.insert("rng.spare_normal".into(), "none".into());
        let e = load_states(&zero, &mut [("rng", &mut r)]).unwrap_err().to_string();
        assert!(e.contains("all zero"), "{e}");
    }
}
