//! [`FsdpConfig`] and [`MixedPrecisionPolicy`].

use tessera_mesh::DType;

/// How [`fully_shard`](crate::fully_shard) shards a module.
///
/// PyTorch: the keyword arguments of `fully_shard`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FsdpConfig {
    /// The mesh dim that shards parameters (`Shard(0)`), by name. `None`: the only
    /// dim of a 1-D mesh, or dim 1 of a 2-D mesh (HSDP: dim 0 replicates).
    pub shard_dim: Option<String>,
    /// Free the unsharded parameters after forward and gather them again for
    /// backward (`true`, FULL_SHARD / ZeRO-3) or keep them until backward
    /// (`false`, SHARD_GRAD_OP / ZeRO-2). `None`: `true`, except for the root
    /// unit (the outermost one called), which keeps its parameters as its backward
    /// starts right after its forward.
    pub reshard_after_forward: Option<bool>,
    /// Where a unit that reshards after forward reshards to: `Some(k)` keeps
    /// each parameter sharded over groups of `k` consecutive ranks of the shard
    /// dim (say, the ranks of one node) instead of over the whole dim, so
    /// backward's all-gather runs within a group: more memory between forward
    /// and backward (`1/k` of each unsharded parameter), less traffic across
    /// groups. `k` must divide the shard dim. `None`: the whole shard dim.
    ///
    /// PyTorch: an integer `reshard_after_forward` (hpZ).
    pub reshard_after_forward_to: Option<usize>,
    /// Mixed precision.
    pub mp_policy: MixedPrecisionPolicy,
    /// Parameters of the module that FSDP leaves alone, by name (`Param::name`,
    /// the state-dict key): not sharded, not gathered, their gradients reduced
    /// by autograd as for any replicated parameter (an all-reduce each). Names
    /// (not handles) so that one config serves every rank's thread.
    ///
    /// PyTorch: `fully_shard(..., ignored_params=...)`.
    pub ignored_params: Vec<String>,
}

/// The dtypes of the unsharded parameters and of gradient reduction. Sharded
/// (master) parameters, their gradients and the optimizer keep the parameters'
/// own dtype.
///
/// PyTorch: `torch.distributed.fsdp.MixedPrecisionPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedPrecisionPolicy {
    /// Dtype of the all-gather and of the unsharded parameters (so of forward and
    /// backward compute). `None`: the parameters' dtype.
    pub param_dtype: Option<DType>,
    /// Dtype in which gradients are reduce-scattered (and all-reduced for HSDP).
    /// `None`: `param_dtype`.
    pub reduce_dtype: Option<DType>,
    /// Dtype the unit's forward output is cast to. `None`: left as computed.
    pub output_dtype: Option<DType>,
    /// Cast floating-point forward inputs to `param_dtype`.
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecisionPolicy {
    fn default() -> Self {
        MixedPrecisionPolicy {
            param_dtype: None,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }
}

impl MixedPrecisionPolicy {
    /// bf16 compute and all-gathers, f32 gradient reduction (the usual recipe).
    pub fn bf16() -> MixedPrecisionPolicy {
        MixedPrecisionPolicy {
            param_dtype: Some(DType::BF16),
            reduce_dtype: Some(DType::F32),
            ..MixedPrecisionPolicy::default()
        }
    }
}
