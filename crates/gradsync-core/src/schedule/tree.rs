//! Tree schedules (placeholder, being written).
