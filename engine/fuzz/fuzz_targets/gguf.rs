//! Arbitrary bytes as a GGUF file: the header, metadata and tensor-info parser
//! (`GgufFile::from_bytes`), dequantization of every tensor it accepts, the tokenizer
//! rebuilt from its metadata, and, for files that parse, the whole import to an HF
//! directory (`import_gguf`: metadata → config.json, tensors → safetensors). Nothing
//! may panic or allocate without bound; an import that succeeds must write a
//! config.json the model loader accepts. The written tokenizer.json is not loaded back:
//! the tokenizers crate compiling yatt's fixed pre-tokenizer regexes took 90% of each
//! execution and depends on nothing in the input but the pre-tokenizer's name.
#![no_main]

#[path = "scratch.rs"]
mod scratch;

use libfuzzer_sys::fuzz_target;
use yatt_engine::gguf::{build_tokenizer_json, import_gguf, GgufFile, ImportDtype, ImportOptions};
use yatt_engine::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    for t in &g.tensors {
        // The parser bounds-checked every tensor it accepted.
        let bytes = g.tensor_bytes(t).expect("an accepted tensor has its bytes");
        assert!(bytes.len() <= data.len());
        if t.ty.is_supported() {
            if let Ok(v) = g.dequantize(t) {
                assert_eq!(v.len() as u64, t.numel(), "{}", t.name);
            }
        }
    }
    let _ = build_tokenizer_json(&g);
    drop(g);

    let dir = scratch::dir("gguf");
    let file = dir.join("in.gguf");
    let out = dir.join("out");
    std::fs::write(&file, data).expect("writing the input");
    let _ = std::fs::remove_dir_all(&out);
    let dtype = if data.len() % 2 == 0 {
        ImportDtype::F32
    } else {
        ImportDtype::Bf16
    };
    if import_gguf(&file, &out, &ImportOptions { dtype }).is_ok() {
        if let Err(e) = ModelConfig::from_dir(&out) {
            panic!("import_gguf wrote a config.json the loader refuses: {e}");
        }
    }
});
