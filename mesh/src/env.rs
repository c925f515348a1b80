//! Which backend the environment calls for: [`mpi_env`] detects an MPI launch
//! (`mpirun`/`mpiexec`/`srun`) from the variables the launcher sets;
//! `TESSERA_BACKEND=threads` or `=mpi` overrides the detection.

/// An MPI launch, as read from the environment of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MpiEnv {
    /// Which launcher's variables were found (`"OpenMPI"`, `"PMI"`, `"PMIx"`).
    pub launcher: &'static str,
    /// This process's rank in the MPI world.
    pub rank: usize,
    /// The number of processes, where the launcher says (PMIx alone does not).
    pub size: Option<usize>,
}

/// Detects an MPI launch from the environment: OpenMPI's
/// `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`, then PMI's `PMI_RANK`/`PMI_SIZE`
/// (MPICH, Intel MPI, Slurm with PMI-2), then PMIx's `PMIX_RANK`. `None` when none
/// is set, or when `TESSERA_BACKEND=threads` asks for the threads backend.
///
/// ```
/// // `cargo test` is not started by mpirun.
/// if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none()
///     && std::env::var_os("PMI_SIZE").is_none()
///     && std::env::var_os("PMIX_RANK").is_none()
/// {
///     assert_eq!(tessera_mesh::mpi_env(), None);
/// }
/// ```
pub fn mpi_env() -> Option<MpiEnv> {
    mpi_env_from(|k| std::env::var(k).ok())
}

fn mpi_env_from(var: impl Fn(&str) -> Option<String>) -> Option<MpiEnv> {
    // A bad value is an error at launch (`vars::check`); here it forces nothing.
    let forced = crate::vars::backend_from(&var).ok().flatten();
    if forced == Some("threads") {
        return None;
    }
    let num = |k: &str| var(k).and_then(|v| v.trim().parse::<usize>().ok());
    let found = [
        ("OpenMPI", "OMPI_COMM_WORLD_RANK", Some("OMPI_COMM_WORLD_SIZE")),
        ("PMI", "PMI_RANK", Some("PMI_SIZE")),
        ("PMIx", "PMIX_RANK", None),
    ]
    .into_iter()
    .find_map(|(launcher, rank, size)| {
        Some(MpiEnv {
            launcher,
            rank: num(rank)?,
            size: size.and_then(num),
        })
    });
    match found {
        Some(env) => Some(env),
        // Forced MPI with no launcher variables: a singleton MPI process.
        None if forced == Some("mpi") => Some(MpiEnv {
            launcher: "TESSERA_BACKEND=mpi",
            rank: 0,
            size: None,
        }),
        None => None,
    }
}

/// Whether this process should print the job's summaries: always with the threads
/// backend, on world rank 0 only under MPI.
pub fn is_lead_process() -> bool {
    mpi_env().is_none_or(|e| e.rank == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Option<MpiEnv> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        mpi_env_from(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn detects_each_launcher() {
        assert_eq!(env(&[]), None);
        let ompi = env(&[("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        assert_eq!(
            ompi,
            Some(MpiEnv {
                launcher: "OpenMPI",
                rank: 3,
                size: Some(4)
            })
        );
        let pmi = env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")]).unwrap();
        assert_eq!((pmi.launcher, pmi.rank, pmi.size), ("PMI", 1, Some(2)));
        let pmix = env(&[("PMIX_RANK", "0")]).unwrap();
        assert_eq!((pmix.launcher, pmix.size), ("PMIx", None));
        // OpenMPI sets PMIx variables too; its own win.
        let both = env(&[
            ("PMIX_RANK", "2"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
        ])
        .unwrap();
        assert_eq!((both.launcher, both.size), ("OpenMPI", Some(8)));
    }

    #[test]
    fn backend_override() {
        let forced = [
            ("TESSERA_BACKEND", "threads"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ];
        assert_eq!(env(&forced), None);
        let mpi = env(&[("TESSERA_BACKEND", "mpi")]).unwrap();
        assert_eq!((mpi.rank, mpi.size), (0, None));
        // Unparsable values are not a launch.
        assert_eq!(
            env(&[("OMPI_COMM_WORLD_RANK", "x"), ("OMPI_COMM_WORLD_SIZE", "2")]),
            None
        );
    }
}
