//! Communicator and mesh tests on the threads backend.

mod collectives;
mod divergent;
mod failures;
mod hangs;
mod mesh;
mod waiting;
