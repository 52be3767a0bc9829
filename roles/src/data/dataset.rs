//! Loading a dataset of any format: the format given, or the one the path implies.

use std::path::Path;

use crate::data::arrow_rows::{load_hf_disk, load_parquet};
use crate::data::fields::{DataFields, DataFormat};
use crate::data::jsonl::load_jsonl_with;
use crate::data::prompt::{DataError, Prompt};

/// Loads the prompts of a dataset: a JSONL file, a parquet file or a `save_to_disk`
/// directory. `format` `None` takes it from the path ([`DataFormat::from_path`]);
/// `fields` names the columns. Errors name the file, the row (or line), the column,
/// what is wrong and the fix.
pub fn load_dataset(
    path: impl AsRef<Path>,
    format: Option<DataFormat>,
    fields: &DataFields,
) -> Result<Vec<Prompt>, DataError> {
    let path = path.as_ref();
    if !path.exists() {
        return Err(DataError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        });
    }
    let format = match format.or_else(|| DataFormat::from_path(path)) {
        Some(f) => f,
        None => {
            return Err(DataError::Format {
                path: path.to_path_buf(),
                reason: "cannot tell the format from the name: use a .jsonl or .parquet file or a save_to_disk directory, or set data.format = \"jsonl\" | \"parquet\" | \"hf-disk\"".into(),
            })
        }
    };
    let is_dir = path.is_dir();
    let wrong_kind = |want: &str| DataError::Format {
        path: path.to_path_buf(),
        reason: format!(
            "data.format = \"{format}\" reads {want}, and this is {}",
            if is_dir { "a directory" } else { "a file" }
        ),
    };
    match format {
        DataFormat::Jsonl if is_dir => Err(wrong_kind("a file")),
        DataFormat::Parquet if is_dir => Err(wrong_kind("a file")),
        DataFormat::HfDisk if !is_dir => Err(wrong_kind("a directory")),
        DataFormat::Jsonl => load_jsonl_with(path, fields),
        DataFormat::Parquet => load_parquet(path, fields),
        DataFormat::HfDisk => load_hf_disk(path, fields),
    }
}
