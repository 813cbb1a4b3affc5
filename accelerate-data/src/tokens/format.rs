//! Where the tokens of a file start, how many there are and how wide each is: llm.c's `.bin`
//! header, numpy's `.npy` header, or a raw little-endian array. Pure functions of a file's
//! first bytes and its length, so that they can be fuzzed.

/// How a token is stored on disk (little-endian).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    /// One byte per token (byte-level models).
    U8,
    /// Two bytes (GPT-2's 50,257 tokens: llm.c's version 1, nanoGPT's `.bin`).
    U16,
    /// Four bytes (llm.c's version 7, Llama 3's 128k tokens).
    U32,
    /// Four bytes, signed (numpy's default integer on some platforms); negatives are errors.
    I32,
    /// Eight bytes, signed (numpy's `int64`); values beyond `u32` are errors.
    I64,
}

impl TokenType {
    /// Bytes per token.
    pub fn size(self) -> usize {
        match self {
            Self::U8 => 1,
            Self::U16 => 2,
            Self::U32 | Self::I32 => 4,
            Self::I64 => 8,
        }
    }

    /// The token at the start of `bytes` (at least [`size`](Self::size) of them); `None` when
    /// it does not fit a `u32`.
    pub(crate) fn decode(self, bytes: &[u8]) -> Option<u32> {
        let mut wide = [0u8; 8];
        let size = self.size();
        wide[..size].copy_from_slice(bytes.get(..size)?);
        let value = i64::from_le_bytes(wide);
        match self {
            Self::U8 | Self::U16 | Self::U32 => u32::try_from(value).ok(),
            Self::I32 => {
                u32::try_from(i32::from_le_bytes([wide[0], wide[1], wide[2], wide[3]])).ok()
            }
            Self::I64 => u32::try_from(value).ok(),
        }
    }
}

/// The bytes read from the start of a file to find its layout (llm.c's header is 1 KiB; a
/// numpy header that does not fit is refused).
pub(crate) const HEAD_BYTES: usize = 4096;

/// llm.c's header: 256 little-endian `i32`, of which the first three are used.
const LLMC_HEADER: usize = 256 * 4;
/// llm.c's (magic, version) pairs and the token type each implies.
const LLMC_KINDS: [(i32, i32, TokenType); 2] = [
    (20240520, 1, TokenType::U16), // GPT-2 tokens
    (20240801, 7, TokenType::U32), // Llama 3 tokens
];
const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// Where a file's tokens are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Byte offset of the first token.
    pub start: u64,
    /// Tokens in the file.
    pub tokens: u64,
    /// Their type.
    pub ty: TokenType,
}

/// Why a file's layout cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LayoutError {
    /// Not a format we read, with the reason.
    Format(String),
    /// Shorter than its header says.
    Truncated { expected: u64, found: u64 },
}

/// The layout of a file whose first bytes are `head` (up to [`HEAD_BYTES`]) and whose length
/// is `len`. `.npy` files are recognised by their magic; a file that starts with an llm.c
/// magic number is read by its header; anything else is a raw array of `raw`.
pub(crate) fn layout(head: &[u8], len: u64, raw: TokenType) -> Result<Layout, LayoutError> {
    if head.starts_with(NPY_MAGIC) {
        return npy(head, len);
    }
    let word = |i: usize| {
        head.get(i * 4..i * 4 + 4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if let (Some(magic), Some(version)) = (word(0), word(1))
        && let Some(&(_, _, ty)) = LLMC_KINDS.iter().find(|k| k.0 == magic && k.1 == version)
        && head.len() >= LLMC_HEADER
    {
        let tokens = word(2).and_then(|n| u64::try_from(n).ok()).ok_or_else(|| {
            LayoutError::Format("its llm.c header gives a negative token count".into())
        })?;
        return sized(LLMC_HEADER as u64, tokens, ty, len);
    }
    if let Some(magic) = word(0)
        && LLMC_KINDS.iter().any(|k| k.0 == magic)
    {
        return Err(LayoutError::Format(format!(
            "it starts with llm.c's magic number {magic} but its version {} is not one we know \
             (1: 16-bit tokens, 7: 32-bit tokens) or its header is short",
            word(1).unwrap_or_default()
        )));
    }
    let size = raw.size() as u64;
    if !len.is_multiple_of(size) {
        return Err(LayoutError::Format(format!(
            "as a raw array of {raw:?} tokens its {len} bytes are not a whole number of tokens"
        )));
    }
    Ok(Layout {
        start: 0,
        tokens: len / size,
        ty: raw,
    })
}

/// A layout of `tokens` tokens of `ty` from `start`, checked against the file's length.
fn sized(start: u64, tokens: u64, ty: TokenType, len: u64) -> Result<Layout, LayoutError> {
    let expected = tokens
        .checked_mul(ty.size() as u64)
        .and_then(|bytes| bytes.checked_add(start))
        .ok_or_else(|| LayoutError::Format(format!("its header's {tokens} tokens overflow")))?;
    if len < expected {
        return Err(LayoutError::Truncated {
            expected,
            found: len,
        });
    }
    if len > expected {
        return Err(LayoutError::Format(format!(
            "{} bytes follow the {tokens} tokens its header counts",
            len - expected
        )));
    }
    Ok(Layout { start, tokens, ty })
}

/// numpy's format: magic, version, header length, then a Python dict literal such as
/// `{'descr': '<u2', 'fortran_order': False, 'shape': (1024,), }` padded with spaces.
fn npy(head: &[u8], len: u64) -> Result<Layout, LayoutError> {
    let bad = |why: &str| LayoutError::Format(format!("its .npy header {why}"));
    let (major, rest) = match head.get(6..) {
        Some([major, _minor, rest @ ..]) => (*major, rest),
        _ => return Err(bad("is cut short")),
    };
    let (header_len, text_start): (usize, usize) = match (major, rest) {
        (1, [a, b, ..]) => (usize::from(u16::from_le_bytes([*a, *b])), 10),
        (2 | 3, [a, b, c, d, ..]) => (u32::from_le_bytes([*a, *b, *c, *d]) as usize, 12),
        (1..=3, _) => return Err(bad("is cut short")),
        _ => return Err(bad(&format!("has version {major}, not 1, 2 or 3"))),
    };
    let text = text_start
        .checked_add(header_len)
        .and_then(|end| head.get(text_start..end))
        .ok_or_else(|| {
            bad(&format!(
                "says it is {header_len} bytes long, longer than we read"
            ))
        })?;
    let text = std::str::from_utf8(text).map_err(|_| bad("is not text"))?;
    let descr = dict_value(text, "descr").ok_or_else(|| bad("has no 'descr'"))?;
    let ty = match descr.trim_matches(|c| c == '\'' || c == '"') {
        "|u1" | "u1" | "<u1" => TokenType::U8,
        "<u2" => TokenType::U16,
        "<u4" => TokenType::U32,
        "<i4" => TokenType::I32,
        "<i8" => TokenType::I64,
        other => {
            return Err(bad(&format!(
                "stores {other}, not little-endian unsigned 8/16/32-bit or signed 32/64-bit \
                 integers"
            )));
        }
    };
    let shape = dict_value(text, "shape").ok_or_else(|| bad("has no 'shape'"))?;
    let dims = shape
        .trim_start_matches('(')
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            d.parse::<u64>()
                .map_err(|_| bad(&format!("has a shape {shape}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let fortran = dict_value(text, "fortran_order").ok_or_else(|| bad("has no 'fortran_order'"))?;
    if fortran == "True" && dims.iter().filter(|&&d| d > 1).count() > 1 {
        return Err(bad("stores a matrix in Fortran order (save it in C order)"));
    }
    let tokens = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(&format!("has a shape {shape} that overflows")))?;
    sized((text_start + header_len) as u64, tokens, ty, len)
}

/// The text of `key`'s value in a Python dict literal: a quoted string, a tuple or a word.
fn dict_value<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let after = ["'", "\""].iter().find_map(|q| {
        let needle = format!("{q}{key}{q}");
        text.find(&needle).map(|at| &text[at + needle.len()..])
    })?;
    let value = after.trim_start().strip_prefix(':')?.trim_start();
    let end = match value.chars().next()? {
        '(' => value.find(')')? + 1,
        q @ ('\'' | '"') => value[1..].find(q)? + 2,
        _ => value.find([',', '}']).unwrap_or(value.len()),
    };
    Some(value[..end].trim())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn llmc(magic: i32, version: i32, tokens: i32) -> Vec<u8> {
        let mut head = vec![0u8; LLMC_HEADER];
        for (i, v) in [magic, version, tokens].into_iter().enumerate() {
            head[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        head
    }

    fn npy_head(dict: &str) -> Vec<u8> {
        let mut head = NPY_MAGIC.to_vec();
        head.extend([1, 0]);
        head.extend((dict.len() as u16).to_le_bytes());
        head.extend(dict.as_bytes());
        head
    }

    #[test]
    fn llmc_headers_give_their_token_type_and_count() {
        let head = llmc(20240520, 1, 10);
        let layout = layout(&head, 1024 + 20, TokenType::U16).unwrap();
        assert_eq!(
            layout,
            Layout {
                start: 1024,
                tokens: 10,
                ty: TokenType::U16
            }
        );
        let head = llmc(20240801, 7, 3);
        assert_eq!(layout_ty(&head, 1024 + 12), TokenType::U32);
        assert_eq!(
            super::layout(&head, 1024 + 11, TokenType::U16),
            Err(LayoutError::Truncated {
                expected: 1036,
                found: 1035
            })
        );
        assert!(matches!(
            super::layout(&llmc(20240520, 3, 1), 1026, TokenType::U16),
            Err(LayoutError::Format(reason)) if reason.contains("version 3")
        ));
    }

    fn layout_ty(head: &[u8], len: u64) -> TokenType {
        layout(head, len, TokenType::U8).unwrap().ty
    }

    #[test]
    fn npy_headers_as_numpy_writes_them() {
        let dict = "{'descr': '<u2', 'fortran_order': False, 'shape': (6,), }          \n";
        let head = npy_head(dict);
        let start = (10 + dict.len()) as u64;
        let layout = layout(&head, start + 12, TokenType::U8).unwrap();
        assert_eq!(
            layout,
            Layout {
                start,
                tokens: 6,
                ty: TokenType::U16
            }
        );
        let dict = "{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3), }\n";
        assert_eq!(
            super::layout(
                &npy_head(dict),
                (10 + dict.len() + 48) as u64,
                TokenType::U8
            )
            .unwrap()
            .tokens,
            6
        );
        let dict = "{'descr': '>u2', 'fortran_order': False, 'shape': (6,), }\n";
        assert!(super::layout(&npy_head(dict), 100, TokenType::U8).is_err());
    }

    #[test]
    fn raw_arrays_are_whole_numbers_of_tokens() {
        assert_eq!(layout(&[1, 2, 3, 4], 4, TokenType::U16).unwrap().tokens, 2);
        assert!(layout(&[1, 2, 3], 3, TokenType::U16).is_err());
    }

    #[test]
    fn tokens_decode_little_endian_and_refuse_what_does_not_fit() {
        assert_eq!(TokenType::U16.decode(&[1, 2]), Some(0x0201));
        assert_eq!(TokenType::I32.decode(&(-1i32).to_le_bytes()), None);
        assert_eq!(TokenType::I64.decode(&(1i64 << 40).to_le_bytes()), None);
        assert_eq!(TokenType::I64.decode(&7i64.to_le_bytes()), Some(7));
    }

    proptest! {
        // Any bytes at all, and any bytes after a real magic: an answer, never a panic.
        #[test]
        fn any_head_gives_a_layout_or_an_error(head in proptest::collection::vec(any::<u8>(), 0..1100), len in any::<u64>()) {
            let _ = layout(&head, len, TokenType::U16);
            let mut npy = NPY_MAGIC.to_vec();
            npy.extend(&head);
            let _ = layout(&npy, len, TokenType::U16);
            let mut llm = llmc(20240520, 1, 0);
            llm.truncate(8);
            llm.extend(&head);
            let _ = layout(&llm, len, TokenType::U16);
        }

        #[test]
        fn any_npy_dict_gives_a_layout_or_an_error(dict in "\\PC{0,120}", len in 0u64..1 << 20) {
            let _ = layout(&npy_head(&dict), len, TokenType::U16);
        }
    }
}
