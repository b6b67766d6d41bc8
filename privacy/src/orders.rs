//! The Rényi orders an accountant tracks.

use crate::error::{Bounds, Parameter, PrivacyError};
use crate::limits;

/// A checked, nonempty list of Rényi orders α, each in
/// [`limits::ORDER`], at most [`limits::MAX_ORDERS`] of them. A guarantee
/// is the best over these orders, so a finer list can only lower ε.
#[derive(Debug, Clone, PartialEq)]
pub struct Orders(Vec<f64>);

impl Orders {
    pub fn new(orders: Vec<f64>) -> Result<Orders, PrivacyError> {
        if orders.is_empty() || orders.len() > limits::MAX_ORDERS {
            return Err(PrivacyError::OutOfRange {
                parameter: Parameter::Orders,
                value: orders.len() as f64,
                bounds: Bounds::closed(1.0, limits::MAX_ORDERS as f64),
            });
        }
        for &order in &orders {
            limits::ORDER.check(Parameter::Order, order)?;
        }
        Ok(Orders(orders))
    }

    /// 1.1 to 10.9 by 0.1, every integer from 11 to 63, then 128, 256,
    /// 512 and 1024: the fine steps where moderate ε (1 to 10) is decided,
    /// the large orders for small ε, whose best order grows like
    /// 2·ln(1/δ)/ε. This is the list of Google's `dp_accounting`; Opacus's
    /// stops at 63.
    pub fn standard() -> Orders {
        let fine = (1..100).map(|tenth| 1.0 + f64::from(tenth) / 10.0);
        let integers = (11..64).map(f64::from);
        let large = [128.0, 256.0, 512.0, 1024.0];
        Orders(fine.chain(integers).chain(large).collect())
    }

    pub fn as_slice(&self) -> &[f64] {
        &self.0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl Default for Orders {
    fn default() -> Orders {
        Orders::standard()
    }
}

/// `order` as an integer, when it is one.
pub(crate) fn integer_order(order: f64) -> Option<u32> {
    (order.fract() == 0.0).then_some(order as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_orders_are_valid_and_ordered() {
        let standard = Orders::standard();
        assert_eq!(
            Orders::new(standard.as_slice().to_vec()),
            Ok(standard.clone())
        );
        assert_eq!(standard.len(), 99 + 53 + 4);
        assert!(standard.as_slice().windows(2).all(|pair| pair[0] < pair[1]));
    }

    #[test]
    fn bad_orders_are_refused_naming_the_parameter() {
        let error = Orders::new(vec![2.0, 1.0]).unwrap_err();
        assert_eq!(error.parameter(), Parameter::Order);
        assert_eq!(error.to_string(), "order is 1, outside (1, 1024]");
        assert_eq!(
            Orders::new(vec![f64::NAN]).unwrap_err().parameter(),
            Parameter::Order
        );
        assert_eq!(
            Orders::new(vec![2048.0]).unwrap_err().parameter(),
            Parameter::Order
        );
        assert_eq!(
            Orders::new(Vec::new()).unwrap_err().parameter(),
            Parameter::Orders
        );
    }
}
