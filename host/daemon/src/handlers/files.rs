//! `folder.*` and `file.*`: sharing host folders with a session, and reading, writing, stating
//! and listing files in it (or, with `host`, on the host side of a shared folder).

use std::sync::Arc;

use serde_json::Value;
use umbra_api::methods::{
    DirList, Done, FileData, FileList, FileRead, FileStatMethod, FileWrite, FolderMount, FolderUnmount, Method,
    Written, MAX_FILE_CHUNK,
};
use umbra_api::{ApiError, Data, ErrorCode};
use umbra_proto::WriteMode;

use super::common::{call, session, Outcome};
use crate::client::Connection;

/// Handles this module's methods; `None` for any other.
pub async fn handle(conn: &Arc<Connection>, method: &str, params: Option<Value>) -> Option<Outcome> {
    Some(match method {
        FolderMount::NAME => {
            call::<FolderMount, _, _>(params, |p| async move { Ok(session(conn, &p.session)?.mount(p.folder).await?) })
                .await
        }
        FolderUnmount::NAME => {
            call::<FolderUnmount, _, _>(params, |p| async move {
                session(conn, &p.session)?.unmount(&p.name).await?;
                Ok(Done {})
            })
            .await
        }
        FileRead::NAME => {
            call::<FileRead, _, _>(params, |p| async move {
                let len = p.len.unwrap_or(MAX_FILE_CHUNK).min(MAX_FILE_CHUNK);
                let (bytes, eof) = session(conn, &p.session)?.read_file(&p.path, p.host, p.offset, len).await?;
                Ok(FileData { data: Data::base64(&bytes), eof })
            })
            .await
        }
        FileWrite::NAME => {
            call::<FileWrite, _, _>(params, |p| async move {
                let bytes = p.data.to_bytes()?;
                if bytes.len() > MAX_FILE_CHUNK as usize {
                    return Err(ApiError::new(
                        ErrorCode::TooLarge,
                        format!(
                            "{} bytes in one write; at most {MAX_FILE_CHUNK} (write in chunks with offset)",
                            bytes.len()
                        ),
                    ));
                }
                let mode = match (p.offset, p.append) {
                    (Some(at), _) => WriteMode::At(at),
                    (None, true) => WriteMode::Append,
                    (None, false) => WriteMode::Truncate,
                };
                let s = session(conn, &p.session)?;
                let bytes = s.write_file(&p.path, p.host, &bytes, mode, p.create_dirs, p.permissions).await?;
                Ok(Written { bytes })
            })
            .await
        }
        FileStatMethod::NAME => {
            call::<FileStatMethod, _, _>(params, |p| async move {
                Ok(session(conn, &p.session)?.stat(&p.path, p.host).await?)
            })
            .await
        }
        FileList::NAME => {
            call::<FileList, _, _>(params, |p| async move {
                let (entries, truncated) = session(conn, &p.session)?.list_dir(&p.path, p.host, p.limit).await?;
                Ok(DirList { entries, truncated })
            })
            .await
        }
        _ => return None,
    })
}
