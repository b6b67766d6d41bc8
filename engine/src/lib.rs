//! `canopy-engine`: the runtime half of Canopy's engine.
