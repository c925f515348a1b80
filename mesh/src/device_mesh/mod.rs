//! [`DeviceMesh`]: an N-D array of ranks with one communicator per dimension.

use std::cell::RefCell;
use std::fmt;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;

use crate::{CommCounts, Communicator, Device, Error, Result};

#[cfg(test)]
mod tests;
mod views;

/// A mesh dimension named by index or by name (`mesh.dim(1)`, `mesh.dim("tp")`).
pub trait DimRef: fmt::Debug {
    /// Resolves to an index into `names` (or checks the index against `ndim`).
    fn resolve(&self, names: &[String], ndim: usize) -> Result<usize>;
}

impl DimRef for usize {
    fn resolve(&self, _names: &[String], ndim: usize) -> Result<usize> {
        if *self < ndim {
            Ok(*self)
        } else {
            Err(Error::Mesh(format!(
                "mesh dim {self} is out of range for a {ndim}-D mesh"
            )))
        }
    }
}

impl DimRef for &str {
    fn resolve(&self, names: &[String], _ndim: usize) -> Result<usize> {
        names.iter().position(|n| n == self).ok_or_else(|| {
            if names.is_empty() {
                Error::Mesh(format!(
                    "no mesh dim named {self:?}: this mesh has no dim names; build it with DeviceMesh::with_names"
                ))
            } else {
                Error::Mesh(format!("no mesh dim named {self:?}; the mesh has dims {names:?}"))
            }
        })
    }
}

struct Inner {
    shape: SmallVec<[usize; 4]>,
    names: Vec<String>,
    /// Rank in `comm` of every mesh position, row-major.
    ranks: Vec<usize>,
    coord: SmallVec<[usize; 4]>,
    comm: Rc<dyn Communicator>,
    dim_comms: Vec<Rc<dyn Communicator>>,
    /// [`DeviceMesh::comm_id`] of `comm` and of each of `dim_comms`.
    comm_id: u64,
    dim_comm_ids: Vec<u64>,
    /// Multi-dim slices made so far, by dim indices (see [`DeviceMesh::slice`]).
    slices: RefCell<Vec<(Vec<usize>, DeviceMesh)>>,
    /// Where this mesh's ranks compute (see [`DeviceMesh::on_device`]).
    device: crate::Device,
}

/// A fresh process-wide number for a communicator a mesh holds.
fn next_comm_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An N-D array of ranks, with optional unique dim names, this rank's coordinate
/// and one sub-communicator per dim (the ranks that differ from this one only
/// along that dim), built once at construction.
///
/// Cheap to clone; lives on its rank's thread (communicators are not `Sync`).
///
/// ```
/// use tessera_mesh::{launch, DeviceMesh};
/// let coords = launch(4, |ctx| {
///     let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2], &["dp", "tp"])?;
///     assert_eq!(mesh.dim("tp")?.size(), 2);
///     Ok(mesh.coordinate().to_vec())
/// })
/// .unwrap();
/// assert_eq!(coords, vec![vec![0, 0], vec![0, 1], vec![1, 0], vec![1, 1]]);
/// ```
///
/// PyTorch: `torch.distributed.device_mesh.DeviceMesh`.
#[derive(Clone)]
pub struct DeviceMesh {
    inner: Rc<Inner>,
}

fn row_major_coord(mut index: usize, shape: &[usize]) -> SmallVec<[usize; 4]> {
    let mut c: SmallVec<[usize; 4]> = SmallVec::from_elem(0, shape.len());
    for (d, &n) in shape.iter().enumerate().rev() {
        c[d] = index % n;
        index /= n;
    }
    c
}

/// The label of the mesh dims `dims` given the mesh's `names`: see
/// [`DeviceMesh::dims_label`].
fn dims_label(names: &[String], dims: impl IntoIterator<Item = usize>) -> String {
    let label = |d: usize| names.get(d).cloned().unwrap_or_else(|| format!("dim{d}"));
    dims.into_iter().map(label).collect::<Vec<_>>().join("×")
}

/// Names `comm` for [`observe`](crate::observe): the mesh dims it runs over.
fn name_comm(comm: &Rc<dyn Communicator>, label: &str) {
    crate::observe::name_group(Rc::as_ptr(comm).cast::<()>() as usize, label);
}

fn row_major_index(coord: &[usize], shape: &[usize]) -> usize {
    coord.iter().zip(shape).fold(0, |acc, (&c, &n)| acc * n + c)
}

impl DeviceMesh {
    /// A mesh of `shape` over `comm`, ranks laid out row-major, dims unnamed.
    /// Collective: every rank of `comm` must call it.
    ///
    /// # Errors
    /// The shape's product differs from `comm.size()`, a dim is 0, or a split fails.
    pub fn new(comm: Box<dyn Communicator>, shape: &[usize]) -> Result<DeviceMesh> {
        DeviceMesh::build(Rc::from(comm), shape, Vec::new())
    }

    /// A mesh of `shape` over `comm` with one unique name per dim.
    /// Collective: every rank of `comm` must call it.
    ///
    /// # Errors
    /// As [`new`](Self::new), plus a name count that differs from the dim count or
    /// duplicate names.
    pub fn with_names(comm: Box<dyn Communicator>, shape: &[usize], names: &[&str]) -> Result<DeviceMesh> {
        if names.len() != shape.len() {
            return Err(Error::Mesh(format!(
                "{} dim names {names:?} for a {}-D shape {shape:?}; give one name per dim",
                names.len(),
                shape.len()
            )));
        }
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(Error::Mesh(format!(
                    "dim name {n:?} is used twice in {names:?}; names must be unique"
                )));
            }
        }
        DeviceMesh::build(Rc::from(comm), shape, names.iter().map(|s| s.to_string()).collect())
    }

    fn build(comm: Rc<dyn Communicator>, shape: &[usize], names: Vec<String>) -> Result<DeviceMesh> {
        if shape.is_empty() || shape.contains(&0) {
            return Err(Error::Mesh(format!(
                "mesh shape {shape:?} must have at least one dim, each of size ≥ 1"
            )));
        }
        let n: usize = shape.iter().product();
        if n != comm.size() {
            return Err(Error::Mesh(format!(
                "mesh shape {shape:?} holds {n} ranks but the communicator has {}; the product of the shape must equal the world size",
                comm.size()
            )));
        }
        let coord = row_major_coord(comm.rank(), shape);
        let mut dim_comms = Vec::with_capacity(shape.len());
        for d in 0..shape.len() {
            // Color: this rank's position with dim d zeroed, unique per line along d.
            let mut base = coord.clone();
            base[d] = 0;
            let color = row_major_index(&base, shape) as u32;
            dim_comms.push(Rc::from(comm.split(color, coord[d] as u32)?));
        }
        // Collectives observed on these communicators name the mesh dims.
        name_comm(&comm, &dims_label(&names, 0..shape.len()));
        for (d, c) in dim_comms.iter().enumerate() {
            name_comm(c, &dims_label(&names, [d]));
        }
        Ok(DeviceMesh {
            inner: Rc::new(Inner {
                shape: shape.into(),
                names,
                ranks: (0..n).collect(),
                coord,
                comm,
                comm_id: next_comm_id(),
                dim_comm_ids: dim_comms.iter().map(|_| next_comm_id()).collect(),
                dim_comms,
                slices: RefCell::default(),
                device: Device::Cpu,
            }),
        })
    }

    /// The mesh shape.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }

    /// Number of mesh dims.
    pub fn ndim(&self) -> usize {
        self.inner.shape.len()
    }

    /// Number of ranks in the mesh.
    pub fn size(&self) -> usize {
        self.inner.ranks.len()
    }

    /// Size of one mesh dim.
    ///
    /// # Errors
    /// An unknown dim.
    pub fn dim_size(&self, d: impl DimRef) -> Result<usize> {
        Ok(self.inner.shape[self.dim_index(d)?])
    }

    /// The dim names (empty when the mesh is unnamed).
    pub fn names(&self) -> &[String] {
        &self.inner.names
    }

    /// How collectives over the mesh dims `dims` are labelled (in observed
    /// events, reports and the op log): their names joined by `×` (`dp×tp`),
    /// `dim{d}` for an unnamed dim.
    pub fn dims_label(&self, dims: &[usize]) -> String {
        dims_label(&self.inner.names, dims.iter().copied())
    }

    /// The index of a dim given by index or name.
    ///
    /// # Errors
    /// An out-of-range index or unknown name.
    pub fn dim_index(&self, d: impl DimRef) -> Result<usize> {
        d.resolve(&self.inner.names, self.ndim())
    }

    /// This rank's coordinate in the mesh.
    pub fn coordinate(&self) -> &[usize] {
        &self.inner.coord
    }

    /// This rank's index in the mesh's communicator.
    pub fn rank(&self) -> usize {
        self.inner.comm.rank()
    }

    /// The rank (in the communicator the mesh was built over) at every mesh position, row-major.
    pub fn ranks(&self) -> &[usize] {
        &self.inner.ranks
    }

    /// The communicator over the whole mesh.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.inner.comm
    }

    /// The communicator of one mesh dim: the ranks that differ from this one only along it.
    ///
    /// # Errors
    /// An unknown dim.
    pub fn dim_comm(&self, d: impl DimRef) -> Result<&dyn Communicator> {
        Ok(&*self.inner.dim_comms[self.dim_index(d)?])
    }

    /// A number identifying the communicator over the whole mesh, unique in this
    /// process: clones of a mesh, and the meshes [`dim`](Self::dim) returns for
    /// one dim, share it; a mesh built over another communicator (another
    /// [`new`](Self::new), a split, [`flatten`](Self::flatten)'s merged dim) has
    /// its own. With the shape, names and ranks, it is what
    /// [`same_as`](Self::same_as) compares, so error messages can name it.
    pub fn comm_id(&self) -> u64 {
        self.inner.comm_id
    }

    /// Where this mesh's ranks compute: DTensors distributed onto it, made by
    /// materialisation or built by ops put their local tensors there.
    /// PyTorch: `DeviceMesh.device_type`.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// This mesh with its ranks computing on `device` (PyTorch:
    /// `init_device_mesh("cuda", shape)`); the meshes later made from it
    /// ([`dim`](Self::dim), [`slice`](Self::slice), ...) inherit it. It shares
    /// this mesh's communicators.
    pub fn on_device(self, device: Device) -> DeviceMesh {
        let i = &self.inner;
        DeviceMesh {
            inner: Rc::new(Inner {
                shape: i.shape.clone(),
                names: i.names.clone(),
                ranks: i.ranks.clone(),
                coord: i.coord.clone(),
                comm: Rc::clone(&i.comm),
                dim_comms: i.dim_comms.clone(),
                comm_id: i.comm_id,
                dim_comm_ids: i.dim_comm_ids.clone(),
                slices: RefCell::default(),
                device,
            }),
        }
    }

    /// Counters of the collectives this rank has issued (all its communicators).
    pub fn stats(&self) -> CommCounts {
        self.inner.comm.stats().snapshot()
    }

    /// Whether two handles denote the same mesh (same construction, cheap check).
    pub fn same_as(&self, other: &DeviceMesh) -> bool {
        Rc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.shape == other.inner.shape
                && self.inner.ranks == other.inner.ranks
                && self.inner.names == other.inner.names
                && Rc::ptr_eq(&self.inner.comm, &other.inner.comm))
    }
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceMesh({:?}", &self.inner.shape[..])?;
        if !self.inner.names.is_empty() {
            write!(f, ", names {:?}", self.inner.names)?;
        }
        write!(f, ", coord {:?})", &self.inner.coord[..])
    }
}
