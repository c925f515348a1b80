//! Meshes derived from a mesh: one of its dims ([`DeviceMesh::dim`]), dims merged
//! ([`DeviceMesh::flatten`]) or split ([`DeviceMesh::unflatten`]), a sub-mesh of
//! some dims ([`DeviceMesh::slice`]), and which dims of a mesh a derived one
//! spans ([`DeviceMesh::dims_of`]).

use std::cell::RefCell;
use std::rc::Rc;

use smallvec::SmallVec;

use super::{DeviceMesh, DimRef, Inner, next_comm_id, row_major_coord, row_major_index};
use crate::{Communicator, Error, Result};

impl DeviceMesh {
    /// The 1-D mesh along one dim, sharing its communicator. Not collective.
    ///
    /// # Errors
    /// An unknown dim.
    pub fn dim(&self, d: impl DimRef) -> Result<DeviceMesh> {
        let i = self.dim_index(d)?;
        let inner = &self.inner;
        let ranks = (0..inner.shape[i])
            .map(|k| {
                let mut c = inner.coord.clone();
                c[i] = k;
                inner.ranks[row_major_index(&c, &inner.shape)]
            })
            .collect();
        Ok(DeviceMesh {
            inner: Rc::new(Inner {
                shape: SmallVec::from_slice(&[inner.shape[i]]),
                names: inner.names.get(i).cloned().into_iter().collect(),
                ranks,
                coord: SmallVec::from_slice(&[inner.coord[i]]),
                comm: inner.dim_comms[i].clone(),
                dim_comms: vec![inner.dim_comms[i].clone()],
                comm_id: inner.dim_comm_ids[i],
                dim_comm_ids: vec![inner.dim_comm_ids[i]],
                slices: RefCell::default(),
                device: self.inner.device,
            }),
        })
    }

    /// Merges adjacent dims `dims` (given in mesh order) into one dim named `name`,
    /// returning the reshaped mesh (the other dims keep their communicators).
    /// Collective over the whole mesh: every rank must call it.
    ///
    /// `mesh.flatten(&["dp_replicate", "dp_shard"], "dp")?.dim("dp")` is the 1-D
    /// data-parallel mesh of an HSDP job.
    ///
    /// # Errors
    /// Unknown, repeated or non-adjacent dims, or a name that is already used by another dim.
    pub fn flatten(&self, dims: &[&str], name: &str) -> Result<DeviceMesh> {
        let idx: Vec<usize> = dims.iter().map(|d| self.dim_index(*d)).collect::<Result<_>>()?;
        let adjacent = !idx.is_empty() && idx.windows(2).all(|w| w[1] == w[0] + 1);
        if !adjacent {
            return Err(Error::Mesh(format!(
                "flatten needs adjacent mesh dims in mesh order; got {dims:?} (indices {idx:?}) of {:?}",
                self.names()
            )));
        }
        let (lo, hi) = (idx[0], idx[idx.len() - 1]);
        let inner = &self.inner;
        if inner
            .names
            .iter()
            .enumerate()
            .any(|(i, n)| n == name && (i < lo || i > hi))
        {
            return Err(Error::Mesh(format!(
                "cannot name the flattened dim {name:?}: another dim has that name"
            )));
        }
        let merged: usize = inner.shape[lo..=hi].iter().product();
        let merged_coord = row_major_index(&inner.coord[lo..=hi], &inner.shape[lo..=hi]);
        let mut base = inner.coord.clone();
        base[lo..=hi].iter_mut().for_each(|c| *c = 0);
        let color = row_major_index(&base, &inner.shape) as u32;
        let comm = Rc::from(inner.comm.split(color, merged_coord as u32)?);
        super::name_comm(&comm, name);
        let splice = |v: &[usize], x: usize| -> SmallVec<[usize; 4]> {
            v[..lo]
                .iter()
                .copied()
                .chain([x])
                .chain(v[hi + 1..].iter().copied())
                .collect()
        };
        let mut dim_comms: Vec<Rc<dyn Communicator>> = inner.dim_comms[..lo].to_vec();
        dim_comms.push(comm);
        dim_comms.extend(inner.dim_comms[hi + 1..].iter().cloned());
        let mut dim_comm_ids = inner.dim_comm_ids[..lo].to_vec();
        dim_comm_ids.push(next_comm_id());
        dim_comm_ids.extend(&inner.dim_comm_ids[hi + 1..]);
        let names = if inner.names.is_empty() {
            Vec::new()
        } else {
            inner.names[..lo]
                .iter()
                .cloned()
                .chain([name.to_string()])
                .chain(inner.names[hi + 1..].iter().cloned())
                .collect()
        };
        Ok(DeviceMesh {
            inner: Rc::new(Inner {
                shape: splice(&inner.shape, merged),
                names,
                ranks: inner.ranks.clone(),
                coord: splice(&inner.coord, merged_coord),
                comm: inner.comm.clone(),
                dim_comms,
                comm_id: inner.comm_id,
                dim_comm_ids,
                slices: RefCell::default(),
                device: self.inner.device,
            }),
        })
    }

    /// Splits dim `d` into dims of sizes `sizes` (row-major: the last varies
    /// fastest along the old dim), named `names` (none for an unnamed mesh). The
    /// other dims keep their communicators; each new dim gets one. Collective
    /// over the whole mesh: every rank must call it.
    ///
    /// `mesh.unflatten("dp", &[2, 4], &["dp_inter", "dp_intra"])` splits 8
    /// data-parallel ranks into 2 groups of 4 consecutive ones.
    ///
    /// PyTorch: `DeviceMesh._unflatten`.
    ///
    /// # Errors
    /// An unknown dim, sizes whose product is not the dim's size or that hold a
    /// 0, names that do not match the sizes or repeat another dim's name, or a
    /// failed split.
    pub fn unflatten(&self, d: impl DimRef, sizes: &[usize], names: &[&str]) -> Result<DeviceMesh> {
        let i = self.dim_index(d)?;
        let inner = &self.inner;
        if sizes.is_empty() || sizes.contains(&0) || sizes.iter().product::<usize>() != inner.shape[i] {
            return Err(Error::Mesh(format!(
                "unflatten: sizes {sizes:?} must multiply to the size {} of mesh dim {i}, each at least 1",
                inner.shape[i]
            )));
        }
        let named = !inner.names.is_empty();
        if names.len() != if named { sizes.len() } else { 0 } {
            return Err(Error::Mesh(format!(
                "unflatten: {} names {names:?} for {} new dims of a mesh {}; give one name per new dim \
                 (none for an unnamed mesh)",
                names.len(),
                sizes.len(),
                if named { "with names" } else { "without names" }
            )));
        }
        for (k, n) in names.iter().enumerate() {
            let elsewhere = inner.names.iter().enumerate().any(|(j, m)| j != i && m == n);
            if elsewhere || names[..k].contains(n) {
                return Err(Error::Mesh(format!(
                    "unflatten: dim name {n:?} is used twice; names must be unique"
                )));
            }
        }
        let sub = row_major_coord(inner.coord[i], sizes);
        let line = &inner.dim_comms[i];
        let mut new_comms: Vec<Rc<dyn Communicator>> = Vec::with_capacity(sizes.len());
        for j in 0..sizes.len() {
            let mut base = sub.clone();
            base[j] = 0;
            let color = row_major_index(&base, sizes) as u32;
            let c: Rc<dyn Communicator> = Rc::from(line.split(color, sub[j] as u32)?);
            super::name_comm(
                &c,
                &names.get(j).map_or_else(|| format!("dim{}", i + j), |n| n.to_string()),
            );
            new_comms.push(c);
        }
        let splice = |v: &[usize], mid: &[usize]| -> SmallVec<[usize; 4]> {
            v[..i].iter().chain(mid).chain(&v[i + 1..]).copied().collect()
        };
        let mut dim_comms: Vec<Rc<dyn Communicator>> = inner.dim_comms[..i].to_vec();
        dim_comms.extend(new_comms);
        dim_comms.extend(inner.dim_comms[i + 1..].iter().cloned());
        let mut dim_comm_ids = inner.dim_comm_ids[..i].to_vec();
        dim_comm_ids.extend(sizes.iter().map(|_| next_comm_id()));
        dim_comm_ids.extend(&inner.dim_comm_ids[i + 1..]);
        let names = if named {
            inner.names[..i]
                .iter()
                .cloned()
                .chain(names.iter().map(|s| s.to_string()))
                .chain(inner.names[i + 1..].iter().cloned())
                .collect()
        } else {
            Vec::new()
        };
        Ok(DeviceMesh {
            inner: Rc::new(Inner {
                shape: splice(&inner.shape, sizes),
                names,
                ranks: inner.ranks.clone(),
                coord: splice(&inner.coord, &sub),
                comm: inner.comm.clone(),
                dim_comms,
                comm_id: inner.comm_id,
                dim_comm_ids,
                slices: RefCell::default(),
                device: self.inner.device,
            }),
        })
    }

    /// The sub-mesh along `dims` (named in mesh order) through this rank: its
    /// dims keep their communicators (so `slice(..).dim(d)` is `dim(d)`), and the
    /// sub-mesh gets a communicator over all its ranks. One dim is
    /// [`dim`](Self::dim); all dims is the mesh itself.
    ///
    /// Collective over the whole mesh the first time a set of dims is sliced
    /// (every rank must call it: the sub-mesh communicator is split then); later
    /// calls return the same sub-mesh without communicating.
    ///
    /// PyTorch: `mesh["dp_replicate", "dp_shard"]`.
    ///
    /// # Errors
    /// No dims, unknown or repeated dims, dims out of mesh order, or a failed split.
    pub fn slice(&self, dims: &[&str]) -> Result<DeviceMesh> {
        let idx: Vec<usize> = dims.iter().map(|d| self.dim_index(*d)).collect::<Result<_>>()?;
        self.slice_dims(&idx)
    }

    /// [`slice`](Self::slice) by dim index: the sub-mesh of dims `idx` (distinct,
    /// in mesh order), collective the first time as `slice` is.
    ///
    /// ```
    /// use tessera_mesh::{launch, DeviceMesh};
    ///
    /// let sizes = launch(8, |ctx| {
    ///     let mesh = DeviceMesh::new(ctx.into_comm(), &[2, 2, 2])?;
    ///     let outer = mesh.slice_dims(&[0, 2])?;
    ///     Ok((outer.shape().to_vec(), outer.comm().size()))
    /// })
    /// .unwrap();
    /// assert!(sizes.iter().all(|s| *s == (vec![2, 2], 4)));
    /// ```
    ///
    /// # Errors
    /// As [`slice`](Self::slice).
    pub fn slice_dims(&self, idx: &[usize]) -> Result<DeviceMesh> {
        if idx.is_empty() || !idx.windows(2).all(|w| w[0] < w[1]) || idx.iter().any(|&d| d >= self.ndim()) {
            return Err(Error::Mesh(format!(
                "slice takes distinct mesh dims in mesh order; got {idx:?} of a {}-D mesh {:?}",
                self.ndim(),
                self.names()
            )));
        }
        let idx = idx.to_vec();
        if idx.len() == 1 {
            return self.dim(idx[0]);
        }
        if idx.len() == self.ndim() {
            return Ok(self.clone());
        }
        let inner = &self.inner;
        if let Some((_, m)) = inner.slices.borrow().iter().find(|(k, _)| *k == idx) {
            return Ok(m.clone());
        }
        let shape: SmallVec<[usize; 4]> = idx.iter().map(|&d| inner.shape[d]).collect();
        let coord: SmallVec<[usize; 4]> = idx.iter().map(|&d| inner.coord[d]).collect();
        // Color: this rank's position with the sliced dims zeroed; key: its place in the slice.
        let mut base = inner.coord.clone();
        idx.iter().for_each(|&d| base[d] = 0);
        let color = row_major_index(&base, &inner.shape) as u32;
        let comm: Rc<dyn Communicator> = Rc::from(inner.comm.split(color, row_major_index(&coord, &shape) as u32)?);
        super::name_comm(&comm, &super::dims_label(&inner.names, idx.iter().copied()));
        let n: usize = shape.iter().product();
        let ranks = (0..n)
            .map(|k| {
                let mut c = inner.coord.clone();
                for (&d, v) in idx.iter().zip(row_major_coord(k, &shape)) {
                    c[d] = v;
                }
                inner.ranks[row_major_index(&c, &inner.shape)]
            })
            .collect();
        let names = if inner.names.is_empty() {
            Vec::new()
        } else {
            idx.iter().map(|&d| inner.names[d].clone()).collect()
        };
        let sliced = DeviceMesh {
            inner: Rc::new(Inner {
                shape,
                names,
                ranks,
                coord,
                comm,
                dim_comms: idx.iter().map(|&d| inner.dim_comms[d].clone()).collect(),
                comm_id: next_comm_id(),
                dim_comm_ids: idx.iter().map(|&d| inner.dim_comm_ids[d]).collect(),
                slices: RefCell::default(),
                device: self.inner.device,
            }),
        };
        inner.slices.borrow_mut().push((idx, sliced.clone()));
        Ok(sliced)
    }

    /// Where the dims of `sub` (a mesh from [`slice`](Self::slice) or
    /// [`dim`](Self::dim) of this one, or this mesh itself) sit in this mesh:
    /// for each dim of `sub`, the index of the dim of `self` that shares its
    /// communicator. `None` when `sub` is not along dims of this mesh through
    /// this rank. Not collective.
    ///
    /// ```
    /// use tessera_mesh::{launch, DeviceMesh};
    ///
    /// launch(8, |ctx| {
    ///     let mesh = DeviceMesh::with_names(ctx.into_comm(), &[2, 2, 2], &["rep", "shard", "tp"])?;
    ///     let dp = mesh.slice(&["rep", "shard"])?;
    ///     assert_eq!(mesh.dims_of(&dp), Some(vec![0, 1]));
    ///     assert_eq!(mesh.dims_of(&mesh.dim("tp")?), Some(vec![2]));
    ///     assert_eq!(dp.dims_of(&mesh), None);
    ///     Ok(())
    /// })
    /// .unwrap();
    /// ```
    pub fn dims_of(&self, sub: &DeviceMesh) -> Option<Vec<usize>> {
        if self.same_as(sub) {
            return Some((0..self.ndim()).collect());
        }
        let inner = &self.inner;
        let mut dims = Vec::with_capacity(sub.ndim());
        for (j, id) in sub.inner.dim_comm_ids.iter().enumerate() {
            let d = inner
                .dim_comm_ids
                .iter()
                .position(|x| x == id)
                .filter(|&d| inner.shape[d] == sub.inner.shape[j] && inner.coord[d] == sub.inner.coord[j])?;
            if dims.contains(&d) {
                return None;
            }
            dims.push(d);
        }
        Some(dims)
    }
}
