//! Rows read into structs. Every query goes through `sqlx::Any`, so a row
//! is an `AnyRow`, read column by field name.

/// Declares a struct and its `sqlx::FromRow` for `AnyRow`: each field is
/// read from the column of its name, and `field: Type as Raw` reads the
/// column as `Raw` and converts it with `TryFrom` (states stored as text).
/// It stands in for sqlx's derive, whose proc-macro crate compiled both
/// database drivers a second time, for the host (ARCHITECTURE.md, "Build
/// time").
macro_rules! any_row {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$field_meta:meta])*
                $field_vis:vis $field:ident : $ty:ty $(as $raw:ty)?
            ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $( $(#[$field_meta])* $field_vis $field: $ty, )*
        }

        impl<'r> sqlx::FromRow<'r, sqlx::any::AnyRow> for $name {
            fn from_row(row: &'r sqlx::any::AnyRow) -> Result<Self, sqlx::Error> {
                Ok(Self {
                    $( $field: $crate::store::row::any_row!(@column row, $field, $ty $(, $raw)?), )*
                })
            }
        }
    };
    (@column $row:ident, $field:ident, $ty:ty) => {
        sqlx::Row::try_get($row, stringify!($field))?
    };
    (@column $row:ident, $field:ident, $ty:ty, $raw:ty) => {{
        let raw: $raw = sqlx::Row::try_get($row, stringify!($field))?;
        <$ty>::try_from(raw).map_err(|error| sqlx::Error::ColumnDecode {
            index: stringify!($field).to_owned(),
            source: error.into(),
        })?
    }};
}

pub(crate) use any_row;
