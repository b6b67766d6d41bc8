//! Loading ONNX Runtime, in a process of its own (this test binary): a
//! missing library or a file that is not one is an error naming the path
//! with a hint, after which the right library still loads; once loaded, a
//! second path is refused.

mod common;

use std::path::PathBuf;

use canopy_npu::{NpuError, OrtBackend, OrtConfig, Provider};

fn open(library: PathBuf) -> Result<OrtBackend, NpuError> {
    OrtBackend::open(&OrtConfig {
        library: Some(library),
        providers: vec![Provider::Cpu],
    })
}

fn assert_library_error(error: NpuError, path: &std::path::Path) {
    let message = error.to_string();
    assert!(matches!(error, NpuError::Library { .. }), "{error:?}");
    assert!(message.contains(&path.display().to_string()), "{message}");
    assert!(message.contains("hint: set ORT_DYLIB_PATH"), "{message}");
    let cause = std::error::Error::source(&error)
        .expect("the loader's reason")
        .to_string();
    assert!(!cause.is_empty());
}

#[test]
fn loading_the_library() {
    let missing = PathBuf::from("/nonexistent/libonnxruntime.so");
    assert_library_error(open(missing.clone()).err().expect("no such file"), &missing);

    let not_a_library = std::env::temp_dir().join(format!("canopy-npu-{}.so", std::process::id()));
    std::fs::write(&not_a_library, b"not a shared library").unwrap();
    let error = open(not_a_library.clone()).err().expect("not a library");
    std::fs::remove_file(&not_a_library).unwrap();
    assert_library_error(error, &not_a_library);

    let backend = open(common::ort_library()).expect("the real library loads after failures");
    assert_eq!(backend.providers(), [Provider::Cpu]);
    assert!(open(common::ort_library()).is_ok(), "the same path again");

    let error = open(missing).err().expect("a second library");
    assert!(
        matches!(error, NpuError::LibraryConflict { .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("already loaded"), "{error}");
}
