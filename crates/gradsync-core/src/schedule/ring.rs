//! Ring schedules (placeholder, being written).
