//! One Arrow IPC file, memory-mapped and decoded in place: the file format (`ARROW1` magic and
//! a footer: pyarrow's `ipc.new_file`, Feather v2) or the stream format (what Hugging Face
//! `datasets` writes as `data-0000x-of-0000n.arrow`). The record batches point into the map;
//! nothing of the data is copied unless a buffer is misaligned.
//!
//! Everything read from the file is checked before arrow-rs slices it (block offsets and
//! lengths against the file), and arrow-rs validates every array it decodes, so a corrupt file
//! is an error naming it and the record batch, never a panic.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::Block;
use arrow_ipc::reader::{FileDecoder, StreamDecoder, read_footer_length};
use arrow_schema::{ArrowError, SchemaRef};

use crate::DataError;

/// The magic that starts (and, with its padding, ends) an Arrow IPC file.
const FILE_MAGIC: &[u8] = b"ARROW1";

/// A file's schema and record batches.
pub(crate) struct IpcFile {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
}

/// Maps `path` and decodes its record batches.
pub(crate) fn read(path: &Path) -> Result<IpcFile, DataError> {
    let file = File::open(path).map_err(|e| DataError::io(path, e))?;
    // SAFETY: the map is read-only and lives as long as the batches that point into it (the
    // Bytes owner). Its contents can change only if another program rewrites the file while
    // we train, as with every reader that maps files (arrow-rs, Hugging Face datasets); such a
    // change can make values wrong, which arrow-rs's validation at decode time does not see
    // afterwards: do not rewrite data files under a running job.
    #[allow(unsafe_code)]
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
    let buffer = Buffer::from(bytes::Bytes::from_owner(map));
    let arrow = |batch: Option<usize>| {
        move |source: ArrowError| DataError::Arrow {
            path: path.to_path_buf(),
            batch,
            source,
        }
    };
    if buffer.starts_with(FILE_MAGIC) {
        read_file_format(&buffer, &arrow)
    } else {
        read_stream_format(buffer, &arrow)
    }
}

/// The file format: the footer lists the schema and where each message is.
fn read_file_format<F, E>(buffer: &Buffer, arrow: &F) -> Result<IpcFile, DataError>
where
    F: Fn(Option<usize>) -> E,
    E: Fn(ArrowError) -> DataError,
{
    let corrupt = |what: String| arrow(None)(ArrowError::IpcError(what));
    let len = buffer.len();
    let trailer: [u8; 10] = buffer
        .get(len.saturating_sub(10)..)
        .and_then(|t| t.try_into().ok())
        .ok_or_else(|| corrupt(format!("{len} bytes are too few for an Arrow file")))?;
    let footer_len = read_footer_length(trailer).map_err(arrow(None))?;
    let footer_start = len
        .checked_sub(10)
        .and_then(|end| end.checked_sub(footer_len))
        .filter(|&start| start >= 8)
        .ok_or_else(|| {
            corrupt(format!(
                "its footer of {footer_len} bytes overruns the file"
            ))
        })?;
    let footer = arrow_ipc::root_as_footer(&buffer[footer_start..len - 10])
        .map_err(|e| corrupt(format!("its footer does not parse: {e}")))?;
    let schema = footer
        .schema()
        .ok_or_else(|| corrupt("its footer has no schema".into()))?;
    let schema = Arc::new(arrow_ipc::convert::try_fb_to_schema(schema).map_err(arrow(None))?);
    let mut decoder = FileDecoder::new(Arc::clone(&schema), footer.version());
    for block in footer.dictionaries().iter().flatten() {
        let data = block_data(buffer, block, footer_start).map_err(arrow(None))?;
        decoder.read_dictionary(block, &data).map_err(arrow(None))?;
    }
    let mut batches = Vec::new();
    for (index, block) in footer.recordBatches().iter().flatten().enumerate() {
        let data = block_data(buffer, block, footer_start).map_err(arrow(Some(index)))?;
        if let Some(batch) = decoder
            .read_record_batch(block, &data)
            .map_err(arrow(Some(index)))?
        {
            batches.push(batch);
        }
    }
    Ok(IpcFile { schema, batches })
}

/// The bytes of the message `block` describes, checked to lie before the footer.
fn block_data(buffer: &Buffer, block: &Block, footer_start: usize) -> Result<Buffer, ArrowError> {
    let offset = usize::try_from(block.offset()).ok();
    let meta = usize::try_from(block.metaDataLength())
        .ok()
        .filter(|&m| m >= 8);
    let body = usize::try_from(block.bodyLength()).ok();
    match (offset, meta, body) {
        (Some(offset), Some(meta), Some(body))
            if meta
                .checked_add(body)
                .and_then(|n| n.checked_add(offset))
                .is_some_and(|end| end <= footer_start) =>
        {
            Ok(buffer.slice_with_length(offset, meta + body))
        }
        _ => Err(ArrowError::IpcError(format!(
            "its footer lists a message at {} of {} + {} bytes, outside the file's {footer_start} \
             bytes of messages",
            block.offset(),
            block.metaDataLength(),
            block.bodyLength()
        ))),
    }
}

/// The stream format: a schema message, then dictionaries and record batches, then an end
/// marker (or the end of the file).
fn read_stream_format<F, E>(mut buffer: Buffer, arrow: &F) -> Result<IpcFile, DataError>
where
    F: Fn(Option<usize>) -> E,
    E: Fn(ArrowError) -> DataError,
{
    let mut decoder = StreamDecoder::new();
    let mut batches = Vec::new();
    while !buffer.is_empty() {
        let index = batches.len();
        match decoder.decode(&mut buffer).map_err(arrow(Some(index)))? {
            Some(batch) => batches.push(batch),
            None if buffer.is_empty() => break,
            None => continue,
        }
    }
    decoder.finish().map_err(arrow(Some(batches.len())))?;
    let schema = decoder.schema().ok_or_else(|| {
        arrow(None)(ArrowError::IpcError(
            "it holds no schema: it is empty or not an Arrow file".into(),
        ))
    })?;
    Ok(IpcFile { schema, batches })
}
