//! Stored responses of `/v1/responses` (`store: true`), shared by every API server of a fleet,
//! Python or Rust: `rankcast/api_server/response_store.py` is the other half, and the files are
//! the contract. The launcher gives the fleet one directory (`RANKCAST_RESPONSE_STORE`); each
//! stored response is one file `resp_<32 hex>.json` holding `{"response": {...}, "messages":
//! [...]}` (as msgspec writes it), written under a temporary name and renamed into place so a
//! reader never sees half of one. Past `MAX_RESPONSES` files or `MAX_BYTES` bytes the oldest
//! are removed, by whichever server stores next. Outside a fleet the store is this process's
//! memory, bounded by count as Python's is.
//!
//! The directory is the process's (it comes from the environment, once), so the store is one
//! value for the process rather than a field every server handler passes around. Its reads and
//! writes are small local files, done in place as the Python servers do them.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use rankcast_frontend::object;
use rankcast_frontend::pyjson::Json;

pub const RESPONSE_STORE_ENV: &str = "RANKCAST_RESPONSE_STORE";
const MAX_RESPONSES: usize = 1000;
const MAX_BYTES: u64 = 64 * (1 << 20);

/// A response as `GET /v1/responses/{id}` answers it, and the conversation it ends as chat
/// messages (its input, then its output), which a continuation starts from.
pub struct StoredResponse {
    pub response: Json,
    pub messages: Vec<Json>,
}

pub struct ResponseStore {
    directory: Option<PathBuf>,
    memory: Mutex<VecDeque<(String, String)>>,
}

/// Ids are ours (`resp_` and 32 hex digits); anything else cannot name a file in the store.
fn valid_id(id: &str) -> bool {
    id.strip_prefix("resp_").is_some_and(|hex| {
        hex.len() == 32
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The process's store: the fleet's directory when the launcher named one.
pub fn store() -> &'static ResponseStore {
    static STORE: OnceLock<ResponseStore> = OnceLock::new();
    STORE.get_or_init(|| {
        let directory = std::env::var_os(RESPONSE_STORE_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        ResponseStore::new(directory)
    })
}

impl ResponseStore {
    pub fn new(directory: Option<PathBuf>) -> ResponseStore {
        if let Some(directory) = &directory {
            if let Err(e) = std::fs::create_dir_all(directory) {
                eprintln!(
                    "rankcast-frontend: response store {}: {e}",
                    directory.display()
                );
            }
        }
        ResponseStore {
            directory,
            memory: Mutex::new(VecDeque::new()),
        }
    }

    pub fn put(&self, id: &str, stored: StoredResponse) -> std::io::Result<()> {
        let data = object![("response", stored.response), ("messages", stored.messages)].event();
        let Some(directory) = &self.directory else {
            let mut memory = self.memory.lock().expect("the store's lock");
            memory.retain(|(key, _)| key != id);
            memory.push_back((id.to_string(), data));
            while memory.len() > MAX_RESPONSES {
                memory.pop_front();
            }
            return Ok(());
        };
        let partial = directory.join(format!(".{id}.tmp"));
        std::fs::write(&partial, data)?;
        std::fs::rename(&partial, directory.join(format!("{id}.json")))?;
        self.bound(directory);
        Ok(())
    }

    pub fn get(&self, id: &str) -> Option<StoredResponse> {
        if !valid_id(id) {
            return None;
        }
        let data = match &self.directory {
            None => {
                let memory = self.memory.lock().expect("the store's lock");
                memory.iter().find(|(key, _)| key == id)?.1.clone()
            }
            Some(directory) => {
                std::fs::read_to_string(directory.join(format!("{id}.json"))).ok()?
            }
        };
        let stored = Json::parse(&data)?;
        let response = stored.get("response")?.clone();
        let Some(Json::Array(messages)) = stored.get("messages") else {
            return None;
        };
        Some(StoredResponse {
            response,
            messages: messages.clone(),
        })
    }

    pub fn delete(&self, id: &str) -> bool {
        if !valid_id(id) {
            return false;
        }
        match &self.directory {
            None => {
                let mut memory = self.memory.lock().expect("the store's lock");
                let before = memory.len();
                memory.retain(|(key, _)| key != id);
                memory.len() != before
            }
            Some(directory) => std::fs::remove_file(directory.join(format!("{id}.json"))).is_ok(),
        }
    }

    /// Remove the oldest files until the store is within both bounds (a file a sibling server
    /// removed meanwhile is skipped).
    fn bound(&self, directory: &PathBuf) {
        let Ok(entries) = std::fs::read_dir(directory) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
            .filter_map(Result::ok)
            .filter(|entry| entry.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|entry| {
                let meta = entry.metadata().ok()?;
                Some((meta.modified().ok()?, meta.len(), entry.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|(_, size, _)| size).sum();
        if files.len() <= MAX_RESPONSES && total <= MAX_BYTES {
            return;
        }
        files.sort();
        let count = files.len();
        for (removed, (_, size, path)) in files.into_iter().enumerate() {
            if count - removed <= MAX_RESPONSES && total <= MAX_BYTES {
                break;
            }
            let _ = std::fs::remove_file(path);
            total -= size;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{ResponseStore, StoredResponse, MAX_RESPONSES};
    use rankcast_frontend::object;
    use rankcast_frontend::pyjson::Json;

    fn stored(n: usize) -> StoredResponse {
        StoredResponse {
            response: object![("id", format!("resp_{n:032x}")), ("temperature", 0.5)],
            messages: vec![object![("role", "user"), ("content", "hé")]],
        }
    }

    #[test]
    fn a_stored_response_reads_back_and_deletes_once() {
        let directory = std::env::temp_dir().join(format!("rankcast-store-{}", std::process::id()));
        for store in [
            ResponseStore::new(None),
            ResponseStore::new(Some(directory.clone())),
        ] {
            let id = format!("resp_{:032x}", 7);
            store.put(&id, stored(7)).unwrap();
            let back = store.get(&id).unwrap();
            assert_eq!(back.response, stored(7).response);
            assert_eq!(back.messages, stored(7).messages);
            assert!(store.get("resp_../../etc/passwd").is_none());
            assert!(store.delete(&id));
            assert!(!store.delete(&id));
            assert!(store.get(&id).is_none());
        }
        let file = std::fs::read_dir(&directory).unwrap().count();
        assert_eq!(file, 0, "no temporary file is left behind");
        std::fs::remove_dir_all(directory).unwrap();
    }

    #[test]
    fn the_store_keeps_the_newest_within_its_bound() {
        let store = ResponseStore::new(None);
        for n in 0..MAX_RESPONSES + 5 {
            store.put(&format!("resp_{n:032x}"), stored(n)).unwrap();
        }
        assert!(store.get(&format!("resp_{:032x}", 4)).is_none());
        assert!(store.get(&format!("resp_{:032x}", 5)).is_some());
        let Json::Object(_) = store.get(&format!("resp_{:032x}", 5)).unwrap().response else {
            panic!("a response object")
        };
    }
}
