//! Replicas that cannot silently differ.
//!
//! Ranks along a `Replicate` mesh dim are meant to hold the same values; when
//! they do not (a rank-dependent seed, a stale file on one node), training
//! blends them without a word. This module hashes a tensor's values
//! ([`tensor_hash`]), checks a [`DTensor`]'s replicas with one small all-gather
//! ([`check_replicas`]), and lets
//! [`distribute_tensor_from`](crate::distribute_tensor_from) agree on one
//! rank's values cheaply: a hash exchange, and a broadcast only when the ranks
//! differ.
//!
//! ```
//! use tessera_dtensor::{check_replicas, distribute_tensor_from, DType, Error, Placement::*, Tensor};
//! use tessera_mesh::{launch, DeviceMesh};
//!
//! launch(2, |ctx| {
//!     let mesh = DeviceMesh::new(ctx.into_comm(), &[2])?;
//!     // A rank-dependent "full" tensor, trusted as it is (no source rank)...
//!     let full = Tensor::full(&[4], mesh.rank() as f64, DType::F32)?;
//!     let w = distribute_tensor_from(&full, &mesh, &[Replicate], None)?;
//!     // ...is caught on every rank.
//!     let err = check_replicas(&w, "w").unwrap_err();
//!     assert!(matches!(err, Error::ReplicasDiffer(d) if d.ranks == [1]));
//!     // With a source rank, every rank holds rank 0's values.
//!     let w = distribute_tensor_from(&full, &mesh, &[Replicate], Some(0))?;
//!     check_replicas(&w, "w")?;
//!     Ok(())
//! })
//! .unwrap();
//! ```
//!
//! Ranks here are positions in the mesh's row-major order, which are the ranks
//! of its communicator ([`DeviceMesh::comm`]): the world ranks for a mesh built
//! over the whole job.

use tessera_mesh::{Buffer, CommunicatorExt, DType, DeviceMesh};

use crate::sharding::mesh_coords;
use crate::{DTensor, Error, Placement, ReplicaDivergence, Result, Tensor};

/// A 64-bit hash of a tensor's dtype, shape and elements: equal tensors (same
/// dtype, shape and element bytes) hash equally whatever their strides and
/// storage offset, since the elements are read in logical row-major order.
///
/// The hash is XXH64 (seed 0) of the dtype's index in [`DType::ALL`], the number
/// of dims and every dim as little-endian `u64`s, then the elements' bytes as
/// they lie in memory (little-endian on the machines Tessera runs on). It runs
/// at memory speed on contiguous tensors (several GB/s on one core); a strided
/// view is copied to row-major order a few MiB at a time. Not cryptographic:
/// it tells replicas apart, it does not resist an adversary.
///
/// ```
/// use tessera_dtensor::{tensor_hash, DType, Tensor};
///
/// let t = Tensor::arange(6, DType::F32)?.reshape(&[2, 3])?;
/// let transposed_twice = t.transpose(0, 1)?.contiguous().transpose(0, 1)?;
/// assert_eq!(tensor_hash(&t), tensor_hash(&transposed_twice));
/// assert_ne!(tensor_hash(&t), tensor_hash(&t.reshape(&[3, 2])?));
/// # Ok::<(), tessera_dtensor::Error>(())
/// ```
pub fn tensor_hash(t: &Tensor) -> u64 {
    hash_in_pieces(t, PIECE_BYTES)
}

/// Checks that the ranks along every `Replicate` mesh dim of `t` hold equal
/// local pieces. Collective over `t`'s mesh: every rank must call it, and every
/// rank returns the same verdict.
///
/// Each rank hashes its local tensor ([`tensor_hash`]) and the hashes are
/// gathered once over the whole mesh (one all-gather of a few `u64`s per rank);
/// each rank then compares, along each `Replicate` dim, every rank with the
/// rank at coordinate 0 of that dim through it. `Shard` dims differ
/// legitimately and `Partial` dims hold partial values, so neither is checked.
/// `what` names the tensor in the error (a parameter's name).
///
/// PyTorch has no such check; its `distribute_tensor(..., src_data_rank=0)`
/// avoids the problem by taking one rank's values, as
/// [`distribute_tensor`](crate::distribute_tensor) does.
///
/// # Errors
/// [`Error::ReplicasDiffer`] naming the first mesh dim (in mesh order) whose
/// ranks differ, the ranks that differ and the ranks they were compared with;
/// [`Error::Placement`] when the ranks pass tensors of different layouts; a
/// communication failure.
pub fn check_replicas(t: &DTensor, what: &str) -> Result<()> {
    let mesh = t.mesh();
    let checked: Vec<usize> = (0..mesh.ndim())
        .filter(|&d| t.placements()[d] == Placement::Replicate && mesh.shape()[d] > 1)
        .collect();
    let values = if checked.is_empty() {
        0
    } else {
        tensor_hash(t.to_local())
    };
    let layout = text_hash(&format!("{:?}", t.layout()));
    let all = gather_words(mesh, &[layout, values])?;
    let other_layout: Vec<usize> = (0..all.len()).filter(|&p| all[p][0] != all[0][0]).collect();
    if !other_layout.is_empty() {
        return Err(Error::Placement {
            op: "check_replicas",
            detail: format!(
                "ranks {other_layout:?} hold `{what}` with another layout than rank 0; \
                 every rank must pass its piece of the same DTensor (this rank: {})",
                t.layout()
            ),
        });
    }
    let coords = mesh_coords(mesh.shape());
    for d in checked {
        let stride: usize = mesh.shape()[d + 1..].iter().product();
        let reference_of = |p: usize| p - coords[p][d] * stride;
        let ranks: Vec<usize> = (0..all.len())
            .filter(|&p| all[p][1] != all[reference_of(p)][1])
            .collect();
        if !ranks.is_empty() {
            let mut reference: Vec<usize> = ranks.iter().map(|&p| reference_of(p)).collect();
            reference.sort_unstable();
            reference.dedup();
            return Err(Error::ReplicasDiffer(Box::new(ReplicaDivergence {
                what: what.to_string(),
                mesh_dim: d,
                dim_name: mesh.names().get(d).cloned(),
                dim_size: mesh.shape()[d],
                ranks,
                reference,
            })));
        }
    }
    Ok(())
}

/// Rank `src`'s full tensor on every rank of `mesh`, for
/// [`distribute_tensor_from`](crate::distribute_tensor_from). Collective.
///
/// One all-gather of `src`, a hash of `args` (the placements and shard order),
/// of the dtype and shape, the number of dims and of the values; then every
/// rank checks the same things in the same order, so all return the same
/// error or none. When every rank's values hash as `src`'s, `full` is returned
/// (no data moves); otherwise `src` broadcasts its tensor.
pub(crate) fn take_from(full: &Tensor, mesh: &DeviceMesh, args: &str, src: usize) -> Result<Tensor> {
    let meta = meta_hash(full.dtype(), full.shape());
    let words = [src as u64, text_hash(args), meta, full.rank() as u64, tensor_hash(full)];
    let all = gather_words(mesh, &words)?;
    let n = all.len();
    let srcs: Vec<u64> = all.iter().map(|w| w[0]).collect();
    if srcs.iter().any(|&s| s != srcs[0]) {
        return Err(Error::Distribute {
            detail: format!(
                "the ranks pass different src_data_rank ({srcs:?}, by rank); every rank must pass the same one"
            ),
        });
    }
    if src >= n {
        return Err(Error::Distribute {
            detail: format!(
                "src_data_rank {src} is not a rank of the mesh {:?}, whose {n} ranks are 0..{n} \
                 (row-major over its coordinates)",
                mesh.shape()
            ),
        });
    }
    let differ = |k: usize| -> Vec<usize> { (0..n).filter(|&p| all[p][k] != all[src][k]).collect() };
    let other_args = differ(1);
    if !other_args.is_empty() {
        return Err(Error::Distribute {
            detail: format!(
                "ranks {other_args:?} pass other placements or another shard order than rank {src}; \
                 every rank must pass the same (this rank: {args})"
            ),
        });
    }
    let other_meta = differ(2);
    if !other_meta.is_empty() {
        return Err(meta_mismatch(full, mesh, &all, src, &other_meta)?);
    }
    if differ(4).is_empty() {
        return Ok(full.clone());
    }
    let mut buf = if mesh.comm().rank() == src {
        full.to_buffer()
    } else {
        Buffer::zeros(full.dtype(), full.numel())
    };
    mesh.comm().broadcast(buf.as_buf_mut(), src)?;
    Ok(Tensor::from_buffer(buf, full.shape())?)
}

/// The error for ranks whose full tensor has another dtype or shape than
/// `src`'s, after a second all-gather of every rank's dtype and shape (every
/// rank takes this path together: they all saw the same hashes).
fn meta_mismatch(full: &Tensor, mesh: &DeviceMesh, all: &[Vec<u64>], src: usize, other: &[usize]) -> Result<Error> {
    let width = all.iter().map(|w| w[3]).max().unwrap_or(0) as usize;
    let mut words = vec![dtype_code(full.dtype()), full.rank() as u64];
    words.extend(full.shape().iter().map(|&d| d as u64));
    words.resize(2 + width, 0);
    let metas = gather_words(mesh, &words)?;
    let describe = |p: usize| {
        let w = &metas[p];
        let dtype = DType::ALL
            .get(w[0] as usize)
            .map_or_else(|| format!("dtype #{}", w[0]), |d| d.to_string());
        let ndim = (w[1] as usize).min(width);
        format!("{:?} {dtype}", &w[2..2 + ndim])
    };
    let others: Vec<String> = other.iter().map(|&p| format!("rank {p} a {}", describe(p))).collect();
    Ok(Error::Distribute {
        detail: format!(
            "rank {src} (the source) holds a {} tensor, but {}; every rank must pass a full tensor \
             of the source's shape and dtype",
            describe(src),
            others.join(", ")
        ),
    })
}

/// Every rank's `words` (the same count on every rank), by rank of `mesh`.
/// One all-gather over the whole mesh.
fn gather_words(mesh: &DeviceMesh, words: &[u64]) -> Result<Vec<Vec<u64>>> {
    debug_assert_eq!(
        mesh.comm().rank(),
        mesh.coordinate()
            .iter()
            .zip(mesh.shape())
            .fold(0, |acc, (&c, &n)| acc * n + c),
        "a mesh's communicator ranks its positions in row-major order"
    );
    // Sent as i64, the 64-bit element type communicators move; bits unchanged.
    let send: Vec<i64> = words.iter().map(|&w| w as i64).collect();
    let all = mesh.comm().all_gather_vec(&send)?;
    Ok(all
        .chunks(words.len().max(1))
        .map(|c| c.iter().map(|&w| w as u64).collect())
        .collect())
}

/// The index of `dtype` in [`DType::ALL`].
fn dtype_code(dtype: DType) -> u64 {
    DType::ALL.iter().position(|&d| d == dtype).unwrap_or(DType::ALL.len()) as u64
}

/// A hash of a dtype and a shape (the prefix [`tensor_hash`] starts with).
fn meta_hash(dtype: DType, shape: &[usize]) -> u64 {
    let mut h = Xxh64::new();
    feed_meta(&mut h, dtype, shape);
    h.finish()
}

fn feed_meta(h: &mut Xxh64, dtype: DType, shape: &[usize]) {
    h.update(&dtype_code(dtype).to_le_bytes());
    h.update(&(shape.len() as u64).to_le_bytes());
    for &d in shape {
        h.update(&(d as u64).to_le_bytes());
    }
}

fn text_hash(s: &str) -> u64 {
    let mut h = Xxh64::new();
    h.update(s.as_bytes());
    h.finish()
}

/// How many bytes of a strided view [`tensor_hash`] copies to row-major order at a time.
const PIECE_BYTES: usize = 4 << 20;

/// [`tensor_hash`], copying strided views at most about `piece_bytes` at a time.
fn hash_in_pieces(t: &Tensor, piece_bytes: usize) -> u64 {
    let mut h = Xxh64::new();
    feed_meta(&mut h, t.dtype(), t.shape());
    feed_elements(&mut h, t, 0, piece_bytes);
    h.finish()
}

/// Feeds `t`'s elements in row-major order. Every dim before `dim` has size 1,
/// so pieces of `t` along `dim` follow one another in row-major order.
fn feed_elements(h: &mut Xxh64, t: &Tensor, dim: usize, piece_bytes: usize) {
    if t.numel() == 0 {
        return;
    }
    if let Ok(buf) = t.as_buf() {
        h.update(buf.as_bytes());
        return;
    }
    // Strided: copy to row-major order, in pieces along `dim` when it is large.
    if t.size_in_bytes() <= piece_bytes || dim + 1 >= t.rank() {
        h.update(t.to_buffer().as_buf().as_bytes());
        return;
    }
    let n = t.shape()[dim];
    let rows = (piece_bytes / (t.size_in_bytes() / n)).max(1);
    for start in (0..n).step_by(rows) {
        // INVARIANT: `dim < rank` and `start + len <= n`, so the narrow is in range.
        let piece = t
            .narrow(dim, start, rows.min(n - start))
            .expect("a narrow within the tensor's bounds");
        if rows == 1 {
            feed_elements(h, &piece, dim + 1, piece_bytes);
        } else {
            h.update(piece.to_buffer().as_buf().as_bytes());
        }
    }
}

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;
const P4: u64 = 0x85EB_CA77_C2B2_AE63;
const P5: u64 = 0x27D4_EB2F_1656_67C5;

/// Streaming XXH64 with seed 0 (Yann Collet's xxHash, 64-bit variant): four
/// independent lanes over 32-byte stripes, so it runs at memory speed.
struct Xxh64 {
    lanes: [u64; 4],
    /// The bytes of an unfinished stripe.
    pending: [u8; 32],
    pending_len: usize,
    total: u64,
}

fn round(acc: u64, word: u64) -> u64 {
    acc.wrapping_add(word.wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1)
}

fn merge(h: u64, lane: u64) -> u64 {
    (h ^ round(0, lane)).wrapping_mul(P1).wrapping_add(P4)
}

fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

impl Xxh64 {
    fn new() -> Xxh64 {
        Xxh64 {
            lanes: [P1.wrapping_add(P2), P2, 0, P1.wrapping_neg()],
            pending: [0; 32],
            pending_len: 0,
            total: 0,
        }
    }

    fn stripe(&mut self, s: &[u8]) {
        for (lane, w) in self.lanes.iter_mut().zip(s.chunks_exact(8)) {
            *lane = round(*lane, word(w));
        }
    }

    fn update(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.pending_len > 0 {
            let take = (32 - self.pending_len).min(data.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&data[..take]);
            self.pending_len += take;
            data = &data[take..];
            if self.pending_len < 32 {
                return;
            }
            let stripe = self.pending;
            self.stripe(&stripe);
            self.pending_len = 0;
        }
        let mut stripes = data.chunks_exact(32);
        for s in &mut stripes {
            self.stripe(s);
        }
        let rest = stripes.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.pending_len = rest.len();
    }

    fn finish(&self) -> u64 {
        let mut h = if self.total >= 32 {
            let [a, b, c, d] = self.lanes;
            let h = a
                .rotate_left(1)
                .wrapping_add(b.rotate_left(7))
                .wrapping_add(c.rotate_left(12))
                .wrapping_add(d.rotate_left(18));
            self.lanes.iter().fold(h, |h, &lane| merge(h, lane))
        } else {
            P5
        };
        h = h.wrapping_add(self.total);
        let mut rest = &self.pending[..self.pending_len];
        while rest.len() >= 8 {
            h ^= round(0, word(rest));
            h = h.rotate_left(27).wrapping_mul(P1).wrapping_add(P4);
            rest = &rest[8..];
        }
        if rest.len() >= 4 {
            let w = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            h ^= u64::from(w).wrapping_mul(P1);
            h = h.rotate_left(23).wrapping_mul(P2).wrapping_add(P3);
            rest = &rest[4..];
        }
        for &b in rest {
            h ^= u64::from(b).wrapping_mul(P5);
            h = h.rotate_left(11).wrapping_mul(P1);
        }
        h ^= h >> 33;
        h = h.wrapping_mul(P2);
        h ^= h >> 29;
        h = h.wrapping_mul(P3);
        h ^ (h >> 32)
    }
}

#[cfg(test)]
mod tests;
