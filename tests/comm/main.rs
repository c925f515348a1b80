//! Communicator and mesh tests on the threads backend.

mod blame;
mod collectives;
mod divergent;
mod failures;
mod hangs;
mod mesh;
mod waiting;
