//! TensorBoard's event file: TFRecord framing (length, masked CRC-32C of the length, the
//! record, its masked CRC-32C) around `tensorflow.Event` protocol buffers, with just the
//! messages we write (scalars, text, and the hparams plugin's session records). Field
//! numbers are TensorFlow's and TensorBoard's (`event.proto`, `summary.proto`,
//! `tensor.proto`, `plugins/hparams/plugin_data.proto`).

use std::collections::BTreeMap;
use std::io::Write;

use prost::Message;

/// `tensorflow.Event`.
#[derive(Clone, PartialEq, Message)]
pub struct Event {
    /// Seconds since the epoch.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// The training step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// What the event carries.
    #[prost(oneof = "What", tags = "3, 5")]
    pub what: Option<What>,
}

/// `Event.what`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum What {
    /// The first record of a file: `brain.Event:2`.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// Values at a step.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
pub struct Summary {
    /// The values.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<Value>,
}

/// `tensorflow.Summary.Value`.
#[derive(Clone, PartialEq, Message)]
pub struct Value {
    /// The series' name.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// A scalar.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
    /// A tensor (text, the hparams plugin's placeholder).
    #[prost(message, optional, tag = "8")]
    pub tensor: Option<TensorProto>,
    /// Which plugin reads it.
    #[prost(message, optional, tag = "9")]
    pub metadata: Option<SummaryMetadata>,
}

/// `tensorflow.TensorProto`, strings and floats only.
#[derive(Clone, PartialEq, Message)]
pub struct TensorProto {
    /// `DT_FLOAT` = 1, `DT_STRING` = 7.
    #[prost(int32, tag = "1")]
    pub dtype: i32,
    /// Always a scalar here.
    #[prost(message, optional, tag = "2")]
    pub tensor_shape: Option<TensorShape>,
    /// Float values.
    #[prost(float, repeated, tag = "5")]
    pub float_val: Vec<f32>,
    /// String values.
    #[prost(bytes = "vec", repeated, tag = "8")]
    pub string_val: Vec<Vec<u8>>,
}

/// `tensorflow.TensorShapeProto` (no dimensions: a scalar).
#[derive(Clone, PartialEq, Message)]
pub struct TensorShape {}

/// `tensorflow.SummaryMetadata`.
#[derive(Clone, PartialEq, Message)]
pub struct SummaryMetadata {
    /// The plugin and its data.
    #[prost(message, optional, tag = "1")]
    pub plugin_data: Option<PluginData>,
}

/// `tensorflow.SummaryMetadata.PluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct PluginData {
    /// "text", "hparams".
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    /// The plugin's own message.
    #[prost(bytes = "vec", tag = "2")]
    pub content: Vec<u8>,
}

/// `tensorboard.hparams.HParamsPluginData`.
#[derive(Clone, PartialEq, Message)]
pub struct HParamsPluginData {
    /// Always 0.
    #[prost(int32, tag = "1")]
    pub version: i32,
    /// The session record.
    #[prost(oneof = "Session", tags = "3, 4")]
    pub data: Option<Session>,
}

/// `HParamsPluginData.data`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Session {
    /// Written when the run starts.
    #[prost(message, tag = "3")]
    Start(SessionStartInfo),
    /// Written when it ends.
    #[prost(message, tag = "4")]
    End(SessionEndInfo),
}

/// `tensorboard.hparams.SessionStartInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct SessionStartInfo {
    /// The hyperparameters.
    #[prost(btree_map = "string, message", tag = "1")]
    pub hparams: BTreeMap<String, ProtoValue>,
    /// Sessions of one group are one run.
    #[prost(string, tag = "4")]
    pub group_name: String,
    /// Seconds since the epoch.
    #[prost(double, tag = "5")]
    pub start_time_secs: f64,
}

/// `tensorboard.hparams.SessionEndInfo`.
#[derive(Clone, PartialEq, Message)]
pub struct SessionEndInfo {
    /// 1 success, 2 failure.
    #[prost(int32, tag = "1")]
    pub status: i32,
    /// Seconds since the epoch.
    #[prost(double, tag = "2")]
    pub end_time_secs: f64,
}

/// `google.protobuf.Value`: a number, a string or a bool.
#[derive(Clone, PartialEq, Message)]
pub struct ProtoValue {
    /// The value.
    #[prost(oneof = "Kind", tags = "2, 3, 4")]
    pub kind: Option<Kind>,
}

/// `google.protobuf.Value.kind`.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Kind {
    /// A number.
    #[prost(double, tag = "2")]
    Number(f64),
    /// A string.
    #[prost(string, tag = "3")]
    Text(String),
    /// A flag.
    #[prost(bool, tag = "4")]
    Bool(bool),
}

/// `DT_FLOAT`.
pub const DT_FLOAT: i32 = 1;
/// `DT_STRING`.
pub const DT_STRING: i32 = 7;

/// Writes one record: length, its masked CRC, the data, its masked CRC.
pub fn write_record(out: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    out.write_all(&len)?;
    out.write_all(&masked_crc(&len).to_le_bytes())?;
    out.write_all(data)?;
    out.write_all(&masked_crc(data).to_le_bytes())
}

/// Writes `event` as a record.
pub fn write_event(out: &mut impl Write, event: &Event) -> std::io::Result<()> {
    write_record(out, &event.encode_to_vec())
}

/// TFRecord's CRC: CRC-32C, rotated and offset so that a CRC of CRCs is not trivial.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// The records of a file (a test helper; CRCs checked).
#[cfg(test)]
pub fn read_events(bytes: &[u8]) -> Vec<Event> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
        assert_eq!(crc, masked_crc(len_bytes));
        let data = &bytes[at + 12..at + 12 + len];
        let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
        assert_eq!(crc, masked_crc(data));
        out.push(Event::decode(data).unwrap());
        at += 16 + len;
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn masked_crc_matches_tensorflow() {
        // TensorFlow's crc32c_test: the CRC-32C of "a" is 0xc1d04330; TFRecord's mask
        // ((crc >> 15 | crc << 17) + 0xa282ead8) makes it 0x28e46e78.
        assert_eq!(crc32c::crc32c(b"a"), 0xc1d0_4330);
        assert_eq!(super::masked_crc(b"a"), 0x28e4_6e78);
    }
}
