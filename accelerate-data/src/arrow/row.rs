//! One row of an [`ArrowDataset`](super::ArrowDataset), read column by column with the types
//! training data has: text, integers, floats and lists of integers (token ids).

use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type,
    UInt16Type, UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrayRef, RecordBatch};

use crate::DataError;

/// A row: its record batch (shared, not copied) and its place in it.
#[derive(Debug, Clone)]
pub struct ArrowRow {
    batch: RecordBatch,
    row: usize,
    /// The row's index within its file, for errors.
    file_row: usize,
    path: Arc<Path>,
}

impl ArrowRow {
    pub(crate) fn new(batch: RecordBatch, row: usize, file_row: usize, path: Arc<Path>) -> Self {
        Self {
            batch,
            row,
            file_row,
            path,
        }
    }

    /// The file the row is in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The column `name`, whole (the row is at [`index_in_batch`](Self::index_in_batch)).
    pub fn column(&self, name: &str) -> Result<&ArrayRef, DataError> {
        self.batch
            .column_by_name(name)
            .ok_or_else(|| DataError::MissingColumn {
                path: self.path.to_path_buf(),
                column: name.to_string(),
                available: self
                    .batch
                    .schema()
                    .fields()
                    .iter()
                    .map(|f| f.name().as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The row's index within [`column`](Self::column)'s array.
    pub fn index_in_batch(&self) -> usize {
        self.row
    }

    /// A `string`, `large_string` or `string_view` value.
    pub fn text(&self, name: &str) -> Result<&str, DataError> {
        let array = self.present(name)?;
        let text = if let Some(a) = array.as_string_opt::<i32>() {
            a.value(self.row)
        } else if let Some(a) = array.as_string_opt::<i64>() {
            a.value(self.row)
        } else if let Some(a) = array.as_string_view_opt() {
            a.value(self.row)
        } else {
            return Err(self.wrong_type(name, array.as_ref(), "text"));
        };
        Ok(text)
    }

    /// An integer value (any width, signed or not; `u64` beyond `i64` is an error).
    pub fn int(&self, name: &str) -> Result<i64, DataError> {
        let array = self.present(name)?;
        let value = array.slice(self.row, 1);
        match ints(value.as_ref()) {
            Some(Some(values)) if values.len() == 1 => Ok(values[0]),
            _ => Err(self.wrong_type(name, array.as_ref(), "an integer")),
        }
    }

    /// A floating-point value (16, 32 or 64 bits), or an integer as a float.
    pub fn float(&self, name: &str) -> Result<f64, DataError> {
        let array = self.present(name)?;
        let row = self.row;
        if let Some(a) = array.as_primitive_opt::<Float64Type>() {
            Ok(a.value(row))
        } else if let Some(a) = array.as_primitive_opt::<Float32Type>() {
            Ok(f64::from(a.value(row)))
        } else if let Some(a) = array.as_primitive_opt::<Float16Type>() {
            Ok(a.value(row).to_f64())
        } else {
            self.int(name).map(|v| v as f64)
        }
    }

    /// A list of integers (`list<int32>` as Hugging Face stores `input_ids`, any list type and
    /// integer width); a null element is an error.
    pub fn ints(&self, name: &str) -> Result<Vec<i64>, DataError> {
        let (array, values) = self.list(name, "a list of integers")?;
        match ints(values.as_ref()) {
            Some(Some(values)) => Ok(values),
            Some(None) => Err(DataError::Content {
                path: self.path.to_path_buf(),
                reason: format!(
                    "row {} of column `{name}` holds an integer beyond i64",
                    self.file_row
                ),
            }),
            None => Err(self.wrong_type(name, array.as_ref(), "a list of integers")),
        }
    }

    /// A list of floats (16, 32 or 64 bits, or integers) as `f32`: feature vectors, embeddings;
    /// a null element is an error.
    pub fn floats(&self, name: &str) -> Result<Vec<f32>, DataError> {
        let (array, values) = self.list(name, "a list of numbers")?;
        if let Some(a) = values.as_primitive_opt::<Float32Type>() {
            Ok(a.values().to_vec())
        } else if let Some(a) = values.as_primitive_opt::<Float64Type>() {
            Ok(a.values().iter().map(|&v| v as f32).collect())
        } else if let Some(a) = values.as_primitive_opt::<Float16Type>() {
            Ok(a.values().iter().map(|v| v.to_f32()).collect())
        } else if let Some(Some(ints)) = ints(values.as_ref()) {
            Ok(ints.into_iter().map(|v| v as f32).collect())
        } else {
            Err(self.wrong_type(name, array.as_ref(), "a list of numbers"))
        }
    }

    /// The column and the row's list in it (any list type), with an error naming `expected`
    /// when the column holds no lists, and one when the list or an element is null.
    fn list(&self, name: &str, expected: &'static str) -> Result<(&ArrayRef, ArrayRef), DataError> {
        let array = self.present(name)?;
        let values = if let Some(a) = array.as_list_opt::<i32>() {
            a.value(self.row)
        } else if let Some(a) = array.as_list_opt::<i64>() {
            a.value(self.row)
        } else if let Some(a) = array.as_fixed_size_list_opt() {
            a.value(self.row)
        } else {
            return Err(self.wrong_type(name, array.as_ref(), expected));
        };
        if values.null_count() > 0 {
            return Err(self.null(name));
        }
        Ok((array, values))
    }

    /// The column, with an error when the row's value is null.
    fn present(&self, name: &str) -> Result<&ArrayRef, DataError> {
        let array = self.column(name)?;
        if array.is_null(self.row) {
            return Err(self.null(name));
        }
        Ok(array)
    }

    fn null(&self, name: &str) -> DataError {
        DataError::Null {
            path: self.path.to_path_buf(),
            column: name.to_string(),
            row: self.file_row,
        }
    }

    fn wrong_type(&self, name: &str, array: &dyn Array, expected: &'static str) -> DataError {
        DataError::ColumnType {
            path: self.path.to_path_buf(),
            column: name.to_string(),
            found: array.data_type().to_string(),
            expected,
        }
    }
}

/// An integer array's values as `i64`: `None` when it is not an integer array, `Some(None)`
/// when a value does not fit.
fn ints(array: &dyn Array) -> Option<Option<Vec<i64>>> {
    macro_rules! widen {
        ($($ty:ty),*) => {$(
            if let Some(a) = array.as_primitive_opt::<$ty>() {
                return Some(a.values().iter().map(|&v| i64::try_from(v).ok()).collect());
            }
        )*};
    }
    widen!(
        Int64Type, Int32Type, Int16Type, Int8Type, UInt64Type, UInt32Type, UInt16Type, UInt8Type
    );
    None
}
