//! Columnar datasets: Apache Parquet files and Hugging Face datasets saved with
//! `save_to_disk` (Arrow IPC streams), read with the `parquet` and `arrow` crates. Each
//! row becomes a JSON object (strings, numbers, booleans, lists, structs; nulls as
//! null) and then a prompt through [`DataFields`], as a JSONL line does.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type,
    UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{ArrowError, DataType};
use serde_json::{Map, Number, Value};

use crate::data::fields::{DataFields, RowConverter, RowFault};
use crate::data::prompt::{DataError, Prompt};

/// Reads a parquet file (verl's layout: `prompt`, `data_source`,
/// `reward_model.ground_truth`, `extra_info`; any column names through `fields`).
pub(crate) fn load_parquet(path: &Path, fields: &DataFields) -> Result<Vec<Prompt>, DataError> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    let file = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let not_parquet = |e: parquet::errors::ParquetError| {
        DataError::Format {
        path: path.to_path_buf(),
        reason: format!("not a readable parquet file: {e}; write it with pandas' to_parquet or pyarrow.parquet.write_table (codecs: none, snappy)"),
    }
    };
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(not_parquet)?
        .build()
        .map_err(not_parquet)?;
    let mut rows = Rows::new(fields);
    for batch in reader {
        let batch = batch.map_err(|e| arrow_error(path, e))?;
        rows.add_batch(path, &batch)?;
    }
    rows.finish(path)
}

/// Reads a `save_to_disk` directory: the Arrow files `state.json` lists, in order.
pub(crate) fn load_hf_disk(dir: &Path, fields: &DataFields) -> Result<Vec<Prompt>, DataError> {
    let format = |reason: String| DataError::Format {
        path: dir.to_path_buf(),
        reason,
    };
    if dir.join("dataset_dict.json").is_file() {
        let splits: Vec<String> = std::fs::read_dir(dir)
            .map(|it| {
                it.filter_map(|e| e.ok())
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        return Err(format(format!(
            "a DatasetDict (dataset_dict.json): point data.path at one split's directory, one of {splits:?}"
        )));
    }
    let state_path = dir.join("state.json");
    let state = std::fs::read_to_string(&state_path).map_err(|e| {
        format(format!(
            "not a dataset saved with save_to_disk: cannot read state.json ({e}); save it with `Dataset.save_to_disk(dir)`"
        ))
    })?;
    let state: Value = serde_json::from_str(&state)
        .map_err(|e| format(format!("state.json is not valid JSON: {e}")))?;
    let files: Vec<String> = state
        .get("_data_files")
        .and_then(Value::as_array)
        .map(|fs| {
            fs.iter()
                .filter_map(|f| f.get("filename").and_then(Value::as_str).map(String::from))
                .collect()
        })
        .unwrap_or_default();
    if files.is_empty() {
        return Err(format(
            "state.json lists no data files (`_data_files`); save the dataset again with save_to_disk".into(),
        ));
    }
    let mut rows = Rows::new(fields);
    for name in files {
        let path = dir.join(&name);
        for batch in ipc_batches(&path)? {
            let batch = batch.map_err(|e| arrow_error(&path, e))?;
            rows.add_batch(&path, &batch)?;
        }
        rows.next_file();
    }
    rows.finish(dir)
}

type Batches = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>>>;

/// The batches of an Arrow IPC file: the stream format (what `datasets` writes) or the
/// file format (magic `ARROW1`).
fn ipc_batches(path: &Path) -> Result<Batches, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut magic = [0u8; 6];
    let is_file = File::open(path)
        .and_then(|mut f| f.read(&mut magic))
        .map_err(io)?
        == 6
        && &magic == b"ARROW1";
    let file = File::open(path).map_err(io)?;
    let bad = |e: ArrowError| DataError::Format {
        path: path.to_path_buf(),
        reason: format!("not an Arrow IPC file: {e}"),
    };
    Ok(if is_file {
        Box::new(arrow_ipc::reader::FileReader::try_new(file, None).map_err(bad)?)
    } else {
        Box::new(
            arrow_ipc::reader::StreamReader::try_new(std::io::BufReader::new(file), None)
                .map_err(bad)?,
        )
    })
}

fn arrow_error(path: &Path, e: ArrowError) -> DataError {
    DataError::Format {
        path: path.to_path_buf(),
        reason: format!("cannot read a record batch: {e}"),
    }
}

/// Rows of one dataset as they are read, batch by batch.
struct Rows<'a> {
    converter: RowConverter<'a>,
    out: Vec<Prompt>,
    /// Where each prompt came from (file, row in the file), to name duplicate ids.
    origin: Vec<(PathBuf, usize)>,
    /// Rows of the current file read so far.
    row_in_file: usize,
}

impl<'a> Rows<'a> {
    fn new(fields: &'a DataFields) -> Self {
        Rows {
            converter: RowConverter::new(fields),
            out: Vec::new(),
            origin: Vec::new(),
            row_in_file: 0,
        }
    }

    fn next_file(&mut self) {
        self.row_in_file = 0;
    }

    fn add_batch(&mut self, path: &Path, batch: &RecordBatch) -> Result<(), DataError> {
        let schema = batch.schema();
        for i in 0..batch.num_rows() {
            let row = self.row_in_file;
            let err = |column: &str, reason: String| DataError::Row {
                path: path.to_path_buf(),
                row,
                column: column.to_string(),
                reason,
            };
            let mut obj = Map::with_capacity(batch.num_columns());
            for (field, col) in schema.fields().iter().zip(batch.columns()) {
                let v = cell(col.as_ref(), i, field.name()).map_err(|(c, r)| err(&c, r))?;
                obj.insert(field.name().clone(), v);
            }
            match self.converter.convert(obj, self.out.len()) {
                Ok(p) => self.out.push(p),
                Err(RowFault::Field { column, reason }) => return Err(err(&column, reason)),
                Err(RowFault::DuplicateId { id, first }) => {
                    let (file, first_row) = &self.origin[first];
                    return Err(err(
                        "id",
                        format!(
                            "id {id} already used by row {first_row} of {}; ids must be unique",
                            file.display()
                        ),
                    ));
                }
            }
            self.origin.push((path.to_path_buf(), row));
            self.row_in_file += 1;
        }
        Ok(())
    }

    fn finish(self, path: &Path) -> Result<Vec<Prompt>, DataError> {
        if self.out.is_empty() {
            return Err(DataError::Empty(path.to_path_buf()));
        }
        Ok(self.out)
    }
}

fn number(x: f64) -> Value {
    Number::from_f64(x).map_or(Value::Null, Value::Number)
}

/// Row `i` of an Arrow array as JSON; an error names the column path and the type.
fn cell(col: &dyn Array, i: usize, path: &str) -> Result<Value, (String, String)> {
    if col.is_null(i) {
        return Ok(Value::Null);
    }
    let list = |values: &dyn Array| -> Result<Value, (String, String)> {
        (0..values.len())
            .map(|j| cell(values, j, path))
            .collect::<Result<Vec<_>, _>>()
            .map(Value::Array)
    };
    Ok(match col.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(col.as_boolean().value(i)),
        DataType::Int8 => col.as_primitive::<Int8Type>().value(i).into(),
        DataType::Int16 => col.as_primitive::<Int16Type>().value(i).into(),
        DataType::Int32 => col.as_primitive::<Int32Type>().value(i).into(),
        DataType::Int64 => col.as_primitive::<Int64Type>().value(i).into(),
        DataType::UInt8 => col.as_primitive::<UInt8Type>().value(i).into(),
        DataType::UInt16 => col.as_primitive::<UInt16Type>().value(i).into(),
        DataType::UInt32 => col.as_primitive::<UInt32Type>().value(i).into(),
        DataType::UInt64 => col.as_primitive::<UInt64Type>().value(i).into(),
        DataType::Float16 => number(col.as_primitive::<Float16Type>().value(i).to_f64()),
        DataType::Float32 => number(col.as_primitive::<Float32Type>().value(i).into()),
        DataType::Float64 => number(col.as_primitive::<Float64Type>().value(i)),
        DataType::Utf8 => Value::String(col.as_string::<i32>().value(i).to_string()),
        DataType::LargeUtf8 => Value::String(col.as_string::<i64>().value(i).to_string()),
        DataType::Utf8View => Value::String(col.as_string_view().value(i).to_string()),
        DataType::List(_) => list(col.as_list::<i32>().value(i).as_ref())?,
        DataType::LargeList(_) => list(col.as_list::<i64>().value(i).as_ref())?,
        DataType::FixedSizeList(..) => list(col.as_fixed_size_list().value(i).as_ref())?,
        DataType::Struct(fields) => {
            let s = col.as_struct();
            let mut m = Map::with_capacity(fields.len());
            for (f, child) in fields.iter().zip(s.columns()) {
                let p = format!("{path}.{}", f.name());
                m.insert(f.name().clone(), cell(child.as_ref(), i, &p)?);
            }
            Value::Object(m)
        }
        DataType::Dictionary(..) => {
            let d = col.as_any_dictionary();
            let key = d.normalized_keys()[i];
            cell(d.values().as_ref(), key, path)?
        }
        other => {
            return Err((
                path.to_string(),
                format!("values of type {other} are not supported; store the column as strings, numbers, booleans, lists or structs, or drop it"),
            ))
        }
    })
}
