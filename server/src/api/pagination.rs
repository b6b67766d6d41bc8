//! Cursor pagination: `?limit=N&cursor=C`, answered with `next_cursor`.

use serde::Deserialize;
use utoipa::IntoParams;

use crate::error::{ApiError, ApiResult};
use crate::store::Page;

pub const DEFAULT_PAGE_SIZE: u32 = 50;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Items per page, 1 to the server's cap (500 by default).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

impl PageQuery {
    /// An id-keyed page; fetches one extra row to know whether more follow.
    pub fn page(&self, max_page_size: u32) -> ApiResult<Page> {
        let limit = self.limit(max_page_size)?;
        let after = match &self.cursor {
            None => 0,
            Some(cursor) => cursor
                .parse::<i64>()
                .ok()
                .filter(|id| *id >= 0)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "cursor `{}` is not one this server issued",
                        truncate(cursor)
                    ))
                })?,
        };
        Ok(Page {
            after,
            limit: i64::from(limit) + 1,
        })
    }

    pub fn limit(&self, max_page_size: u32) -> ApiResult<u32> {
        let limit = self.limit.unwrap_or(DEFAULT_PAGE_SIZE.min(max_page_size));
        if limit == 0 || limit > max_page_size {
            return Err(ApiError::bad_request(format!(
                "limit must be between 1 and {max_page_size}, got {limit}"
            )));
        }
        Ok(limit)
    }
}

/// Splits off the look-ahead row and makes the next cursor from the last
/// item kept.
pub fn finish<T>(
    mut rows: Vec<T>,
    page: Page,
    key: impl Fn(&T) -> String,
) -> (Vec<T>, Option<String>) {
    let keep = usize::try_from(page.limit - 1).unwrap_or(0);
    if rows.len() > keep {
        rows.truncate(keep);
        let next = rows.last().map(&key);
        (rows, next)
    } else {
        (rows, None)
    }
}

fn truncate(text: &str) -> String {
    text.chars().take(64).collect()
}
