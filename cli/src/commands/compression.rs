//! The `--compress` flags of `canopy job create` and `canopy simulate`: a
//! job's `update_compression` (docs/compression.md). The server checks
//! every setting and names the one it refuses.

use clap::Args;
use serde_json::{Map, Value, json};

#[derive(Args, Debug, Default)]
pub struct JobCompressionArgs {
    /// Compress the devices' updates: `int8` (stochastically rounded, a
    /// scale per block of 256; about a quarter of f32's upload).
    #[arg(long, value_name = "SCHEME")]
    pub compress: Option<String>,
    /// With `--compress int8`: tensors with fewer values stay f32
    /// (20,000 when left out, as TensorFlow Federated).
    #[arg(long, value_name = "N", requires = "compress")]
    pub int8_min_elements: Option<u64>,
}

impl JobCompressionArgs {
    /// The job's `update_compression`, if `--compress` was given.
    pub fn fields(&self) -> Option<Map<String, Value>> {
        let scheme = self.compress.as_ref()?;
        let mut fields = Map::new();
        fields.insert("scheme".into(), json!(scheme));
        if let Some(min_elements) = self.int8_min_elements {
            fields.insert("min_elements".into(), json!(min_elements));
        }
        Some(fields)
    }
}
