//! Cursor pagination: `?limit=N&cursor=C`, answered with `next_cursor`.

use serde::Deserialize;
use utoipa::IntoParams;

use crate::api::error::{ApiError, ApiResult};
use crate::store::Page;

pub const DEFAULT_PAGE_SIZE: u32 = 50;
/// Digits in an id cursor; the OpenAPI document states the cursor as
/// `^[0-9]{1,18}$`, and [`PageQuery::page`] accepts exactly that.
const ID_CURSOR_MAX_DIGITS: usize = 18;

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PageQuery {
    /// Items per page, 1 to the server's cap (500 by default).
    #[param(minimum = 1, maximum = 500)]
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    #[param(pattern = "^[0-9]{1,18}$")]
    pub cursor: Option<String>,
}

impl PageQuery {
    /// An id-keyed page; fetches one extra row to know whether more follow.
    pub fn page(&self, max_page_size: u32) -> ApiResult<Page> {
        let limit = self.limit(max_page_size)?;
        let after = match &self.cursor {
            None => 0,
            // Up to 18 digits always fits an i64; `parse` alone would also
            // take a sign, which the documented pattern does not.
            Some(cursor) => Some(cursor)
                .filter(|cursor| {
                    (1..=ID_CURSOR_MAX_DIGITS).contains(&cursor.len())
                        && cursor.bytes().all(|b| b.is_ascii_digit())
                })
                .and_then(|cursor| cursor.parse::<i64>().ok())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn after(cursor: &str) -> Option<i64> {
        PageQuery {
            limit: None,
            cursor: Some(cursor.to_string()),
        }
        .page(500)
        .ok()
        .map(|page| page.after)
    }

    #[test]
    fn id_cursors_are_exactly_the_documented_pattern() {
        assert_eq!(after("0"), Some(0));
        assert_eq!(after("0042"), Some(42));
        assert_eq!(after("999999999999999999"), Some(999_999_999_999_999_999));
        // `^[0-9]{1,18}$` excludes these, so the server must too.
        for cursor in ["", "+5", "-1", " 7", "7\n", "1e3", "9223372036854775807"] {
            assert_eq!(after(cursor), None, "{cursor:?}");
        }
    }
}
