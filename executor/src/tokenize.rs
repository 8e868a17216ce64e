//! Text prompts: the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`, pure
//! Rust build) turns a prompt into token ids and generated ids back into text.

use std::path::Path;

/// A loaded tokenizer.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .finish()
    }
}

impl TextTokenizer {
    /// `dir/tokenizer.json`, if the checkpoint ships one.
    pub fn from_dir(dir: &Path) -> Result<Option<TextTokenizer>, String> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let bytes = meshplan_ir::input::read_bounded(&path, meshplan_ir::input::TEXT_LIMIT)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        tokenizers::Tokenizer::from_bytes(bytes)
            .map(|inner| Some(TextTokenizer { inner }))
            .map_err(|e| format!("{}: not a tokenizer file: {e}", path.display()))
    }

    /// The ids of `text` (with the special tokens its post-processor adds).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.inner
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("cannot tokenize the prompt: {e}"))
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| format!("cannot detokenize: {e}"))
    }
}
