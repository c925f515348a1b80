//! [`Pieces`]: a send buffer assembled from many slices without copying them.

use crate::{Buf, Buffer, DType, Error, Result};

/// Storage that [`Pieces`] keeps alive and reads: its elements as a [`Buf`].
/// Implemented for [`Buffer`]; other crates implement it for their own
/// shared, immutable storage (a tensor view), so that a collective reads the
/// elements where they are.
pub trait HeldBuf: Send + Sync {
    /// The elements this piece contributes, in order.
    fn held_buf(&self) -> Buf<'_>;
}

impl HeldBuf for Buffer {
    fn held_buf(&self) -> Buf<'_> {
        self.as_buf()
    }
}

/// One piece: held elements, or a run of zeros.
enum Piece {
    Held(Box<dyn HeldBuf>),
    Zeros(usize),
}

/// The send buffer of a collective as the concatenation of pieces, each held
/// elements ([`push`](Self::push)) or zeros ([`push_zeros`](Self::push_zeros)),
/// all of one dtype. A backend that reads its peers' memory (the threads
/// backend) reads every piece in place; others [`pack`](Self::pack) them into
/// one buffer first. FSDP sends a unit's gradients (and its parameter shards)
/// this way: one collective, no copy into a flat bucket.
///
/// PyTorch: FSDP2's copy-in (`torch._foreach_copy_` into the all-gather input,
/// `torch.cat` of the gradients into the reduce-scatter input), which this
/// avoids where the backend allows.
///
/// ```
/// use tessera_mesh::{Buffer, DType, Pieces};
///
/// let mut send = Pieces::new(DType::F32);
/// send.push(Buffer::from(vec![1f32, 2.0])).unwrap();
/// send.push_zeros(1);
/// send.push(Buffer::from(vec![3f32])).unwrap();
/// assert_eq!(send.len(), 4);
/// assert_eq!(send.pack().into_vec::<f32>().unwrap(), vec![1.0, 2.0, 0.0, 3.0]);
/// ```
pub struct Pieces {
    dtype: DType,
    pieces: Vec<Piece>,
    len: usize,
}

impl Pieces {
    /// No pieces yet, of `dtype`.
    pub fn new(dtype: DType) -> Pieces {
        Pieces {
            dtype,
            pieces: Vec::new(),
            len: 0,
        }
    }

    /// Appends `piece`'s elements (kept alive, not copied).
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when the piece is not of this buffer's dtype.
    pub fn push(&mut self, piece: impl HeldBuf + 'static) -> Result<()> {
        let buf = piece.held_buf();
        if buf.dtype() != self.dtype {
            return Err(Error::DTypeMismatch {
                op: "Pieces::push",
                send: buf.dtype(),
                recv: self.dtype,
            });
        }
        let n = buf.len();
        if n > 0 {
            self.len += n;
            self.pieces.push(Piece::Held(Box::new(piece)));
        }
        Ok(())
    }

    /// Appends `len` zeros (nothing is allocated).
    pub fn push_zeros(&mut self, len: usize) {
        if len > 0 {
            self.len += len;
            self.pieces.push(Piece::Zeros(len));
        }
    }

    /// The elements in all.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The dtype of every piece.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Every piece copied, in order, into one buffer.
    pub fn pack(&self) -> Buffer {
        let mut out = Buffer::zeros(self.dtype, self.len);
        crate::dispatch_buf!(BufMut, out.as_buf_mut(), dst, T => {
            let mut at = 0;
            for (src, n) in self.runs() {
                if let Some(src) = src {
                    // Same dtype (checked by `push`), so the cast cannot fail.
                    let src: &[T] = bytemuck::cast_slice(src.as_bytes());
                    dst[at..at + n].copy_from_slice(src);
                }
                at += n;
            }
        });
        out
    }

    /// The pieces in order: `(Some(elements), n)` or `(None, n)` for zeros.
    pub(crate) fn runs(&self) -> impl Iterator<Item = (Option<Buf<'_>>, usize)> {
        self.pieces.iter().map(|p| match p {
            Piece::Held(h) => {
                let b = h.held_buf();
                let n = b.len();
                (Some(b), n)
            }
            Piece::Zeros(n) => (None, *n),
        })
    }
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pieces({} × {}, {} pieces)", self.len, self.dtype, self.pieces.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_pack_in_order_with_zeros_and_refuse_other_dtypes() {
        let mut p = Pieces::new(DType::I64);
        p.push_zeros(2);
        p.push(Buffer::from(vec![5i64, 6])).unwrap();
        p.push(Buffer::from(Vec::<i64>::new())).unwrap();
        p.push_zeros(0);
        p.push(Buffer::from(vec![7i64])).unwrap();
        assert_eq!(p.len(), 5);
        assert_eq!(p.runs().count(), 3, "empty pieces are dropped");
        assert_eq!(p.pack().into_vec::<i64>().unwrap(), vec![0, 0, 5, 6, 7]);
        let err = p.push(Buffer::from(vec![1f32])).unwrap_err().to_string();
        assert!(err.contains("f32") && err.contains("i64"), "{err}");
        assert_eq!(p.len(), 5, "a refused piece adds nothing");
    }
}
