//! In-memory simulator (placeholder, being written).
