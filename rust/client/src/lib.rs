pub use rankcast_wire as wire;
