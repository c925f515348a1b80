//! A checkpoint that is missing, truncated or corrupt, or asked for what it does
//! not hold: each a clear error naming the file and tensor, never a panic.
