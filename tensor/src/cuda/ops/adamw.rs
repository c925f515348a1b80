//! The AdamW step.

use super::*;

/// The per-step scalars of an AdamW step, in f32 (`kernels.cu`'s `AdamScalars`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AdamScalars {
    /// `1 − lr·λ`.
    pub decay: f32,
    /// `1 − β₁` (the weight of `lerp`).
    pub lerp_weight: f32,
    /// `β₂`.
    pub beta2: f32,
    /// `1 − β₂`.
    pub one_minus_beta2: f32,
    /// `√(1 − β₂ᵗ)`.
    pub bias_correction2_sqrt: f32,
    /// `ε`.
    pub eps: f32,
    /// `−lr / (1 − β₁ᵗ)`.
    pub neg_step_size: f32,
    /// Whether `|1 − β₁| < ½` (1 or 0; PyTorch's `lerp` switches formula there).
    pub lerp_small: i32,
}

// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for AdamScalars {}

/// A private copy of `t` when another handle shares its storage (copy on
/// write), so that an in-place kernel changes nothing anyone else sees.
fn make_unique(t: &mut Tensor) -> Result<()> {
    if !t.is_sole_owner() {
        *t = assemble(t.shape(), t.dtype(), t.device(), &[(&vec![0; t.rank()], t)])?;
    }
    Ok(())
}

/// One AdamW step in place on f32 device tensors `p`, `m`, `v` with gradient
/// `g` (each of `p`, `m`, `v` copied first if another handle shares it).
pub(crate) fn adamw_step(
    p: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    scalars: AdamScalars,
) -> Result<()> {
    const OP: &str = "adamw";
    let s = streams_for(OP, &[p, g, m, v])?;
    for t in [&*p, g, &*m, &*v] {
        if t.dtype() != DType::F32 || t.numel() != p.numel() {
            return Err(Error::Device {
                op: OP,
                detail: format!(
                    "the CUDA AdamW step takes f32 tensors of {} elements, got {} {:?}",
                    p.numel(),
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    let g = contiguous(g)?;
    for t in [&mut *p, &mut *m, &mut *v] {
        make_unique(t)?;
    }
    let n = p.numel() as i64;
    let (pp, gp, mp, vp) = (ptr(p), ptr(&g), ptr(m), ptr(v));
    launch!(
        s,
        OP,
        "adamw_f32",
        grid_1d(n as usize),
        &pp,
        &gp,
        &mp,
        &vp,
        &n,
        &scalars
    )
}
