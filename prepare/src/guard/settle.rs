//! Settling a value: lazy containers replaced by plain ones, the whole walked and paid for,
//! and refused when its printed form would pass the fuel left (the parent module says why).
use indexmap::IndexMap;
use minijinja::value::{ObjectRepr, Tuple, Value, ValueKind};
use minijinja::{Error, ErrorKind, State};

/// Deepest nesting a settled value may have (`tojson` stops at the same depth).
pub(crate) const MAX_DEPTH: usize = 512;
/// minijinja's units of fuel: one fuel is 64 units, a byte one unit.
const UNITS_PER_FUEL: u64 = 64;
/// What visiting an item costs, as minijinja's own filters charge it (half a fuel).
pub(super) const ITEM_UNITS: u64 = 32;
/// Printed size assumed of a value that is not a string or a container (a number, a macro).
const SCALAR_BYTES: u64 = 40;
/// A string inside a container prints escaped: `\u{1f}` is six bytes for one.
const ESCAPED_PER_BYTE: u64 = 6;

/// The namespaces of one rendering, registered as `namespace()` makes them: the only objects
/// that change after they are made, kept as they are when settled.
#[derive(Default)]
pub(super) struct Namespaces(pub(super) Vec<Value>);

/// Units of fuel left to the rendering (no bound without fuel).
pub(super) fn units_left(state: &State) -> u64 {
    state
        .fuel_levels()
        .map_or(u64::MAX, |(_, left)| left.saturating_mul(UNITS_PER_FUEL))
}

/// Refuses, as out of fuel, work whose result would take `units` or more.
pub(super) fn ensure(state: &State, units: u64) -> Result<(), Error> {
    if units >= units_left(state) {
        return Err(Error::from(ErrorKind::OutOfFuel));
    }
    Ok(())
}

/// Walks values, settling and sizing them.
pub(super) struct Settler<'a, 's, 'e> {
    state: &'a State<'s, 'e>,
    namespaces: Vec<Value>,
    /// An object the value may not hold (the namespace it is being assigned to).
    forbidden: Option<Value>,
    /// Units of fuel left when the walk started: the most its printed form may take.
    budget: u64,
    /// Estimated bytes of its printed form so far.
    pub(super) printed: u64,
    unpaid: u64,
}

impl<'a, 's, 'e> Settler<'a, 's, 'e> {
    pub(super) fn new(state: &'a State<'s, 'e>, forbidden: Option<Value>) -> Self {
        Settler {
            state,
            namespaces: state
                .get_extension::<Namespaces>()
                .map(|n| n.0.clone())
                .unwrap_or_default(),
            forbidden,
            budget: units_left(state),
            printed: 0,
            unpaid: 0,
        }
    }

    /// `v` settled (a new value only where something lazy was replaced).
    pub(super) fn settle(mut self, v: &Value) -> Result<Value, Error> {
        let settled = self.visit(v, 0)?.unwrap_or_else(|| v.clone());
        self.flush()?;
        Ok(settled)
    }

    /// Only sizes `v` (and pays for walking it).
    pub(super) fn measure(mut self, v: &Value) -> Result<u64, Error> {
        self.visit(v, 0)?;
        self.flush()?;
        Ok(self.printed)
    }

    fn add_printed(&mut self, bytes: u64) -> Result<(), Error> {
        self.printed = self.printed.saturating_add(bytes);
        if self.printed >= self.budget {
            return Err(Error::from(ErrorKind::OutOfFuel));
        }
        Ok(())
    }

    fn pay(&mut self, units: u64) -> Result<(), Error> {
        self.unpaid += units;
        if self.unpaid >= UNITS_PER_FUEL {
            self.state.consume_fuel(self.unpaid / UNITS_PER_FUEL)?;
            self.unpaid %= UNITS_PER_FUEL;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), Error> {
        if self.unpaid > 0 {
            self.state.consume_fuel(1)?;
            self.unpaid = 0;
        }
        Ok(())
    }

    // The settled value of `v` if it differs from `v`.
    fn visit(&mut self, v: &Value, depth: usize) -> Result<Option<Value>, Error> {
        let Some(obj) = v.as_object() else {
            let bytes = match v.kind() {
                ValueKind::String => v.as_str().map_or(0, str::len) as u64 * ESCAPED_PER_BYTE + 2,
                ValueKind::Bytes => v.as_bytes().map_or(0, <[u8]>::len) as u64 * 4 + 3,
                _ => SCALAR_BYTES,
            };
            self.add_printed(bytes)?;
            return Ok(None);
        };
        if depth >= MAX_DEPTH {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("a value nested deeper than {MAX_DEPTH} levels"),
            ));
        }
        if let Some(f) = &self.forbidden {
            if minijinja::tests::is_sameas(f, v) {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "a namespace cannot hold itself, directly or through other values",
                ));
            }
        }
        self.pay(ITEM_UNITS)?;
        self.add_printed(2)?;
        if let Some(items) = v.downcast_object_ref::<Vec<Value>>() {
            return Ok(self.plain_items(items, depth)?.map(Value::from));
        }
        if let Some(t) = v.downcast_object_ref::<Tuple>() {
            let items = self.plain_items(t, depth)?;
            return Ok(items.map(|items| Value::from(Tuple::from(items))));
        }
        if let Some(map) = v.downcast_object_ref::<IndexMap<Value, Value>>() {
            return Ok(self.plain_pairs(map, depth)?.map(Value::from_object));
        }
        if crate::skeleton::is_skeleton_message(v) {
            // Listing its fields would mark the template unfit for skeletons; it holds a role
            // and sentinels.
            self.add_printed(SCALAR_BYTES)?;
            return Ok(None);
        }
        match obj.repr() {
            ObjectRepr::Map => {
                let pairs = obj.try_iter_pairs().into_iter().flatten();
                let map = self.pairs(pairs, depth)?;
                if self
                    .namespaces
                    .iter()
                    .any(|n| minijinja::tests::is_sameas(n, v))
                {
                    // A namespace stays itself: `{% set ns.x %}` needs the object. What it
                    // holds was settled when it was assigned.
                    return Ok(None);
                }
                Ok(Some(Value::from_object(map)))
            }
            ObjectRepr::Seq | ObjectRepr::Iterable => {
                if let Some(n) = obj.enumerator_len() {
                    // Refused before a copy of a long lazy sequence (`[x] * 10**8`) is made.
                    ensure(self.state, (n as u64).saturating_mul(ITEM_UNITS))?;
                }
                let mut items = vec![];
                for item in v.try_iter()?.checked() {
                    let item = item?;
                    self.add_printed(2)?;
                    items.push(self.visit(&item, depth + 1)?.unwrap_or(item));
                }
                Ok(Some(Value::from(items)))
            }
            // A macro, a loop, a function: printed as a short name.
            _ => {
                self.add_printed(SCALAR_BYTES)?;
                Ok(None)
            }
        }
    }

    // The settled items if any differs from the one given.
    fn plain_items(&mut self, items: &[Value], depth: usize) -> Result<Option<Vec<Value>>, Error> {
        let mut out: Option<Vec<Value>> = None;
        for (i, item) in items.iter().enumerate() {
            self.add_printed(2)?;
            match (self.visit(item, depth + 1)?, &mut out) {
                (Some(new), None) => {
                    let mut copy = items[..i].to_vec();
                    copy.push(new);
                    out = Some(copy);
                }
                (new, Some(copy)) => copy.push(new.unwrap_or_else(|| item.clone())),
                (None, None) => {}
            }
        }
        Ok(out)
    }

    // The settled map if any key or value differs from the one given.
    fn plain_pairs(
        &mut self,
        map: &IndexMap<Value, Value>,
        depth: usize,
    ) -> Result<Option<IndexMap<Value, Value>>, Error> {
        let mut out: Option<IndexMap<Value, Value>> = None;
        for (i, (k, v)) in map.iter().enumerate() {
            let (k2, v2) = self.pair(k, v, depth)?;
            if out.is_none() && (k2.is_some() || v2.is_some()) {
                out = Some(
                    map.iter()
                        .take(i)
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                );
            }
            if let Some(out) = &mut out {
                out.insert(
                    k2.unwrap_or_else(|| k.clone()),
                    v2.unwrap_or_else(|| v.clone()),
                );
            }
        }
        Ok(out)
    }

    // The pairs of a lazy map or a namespace, settled.
    fn pairs(
        &mut self,
        pairs: impl Iterator<Item = (Value, Value)>,
        depth: usize,
    ) -> Result<IndexMap<Value, Value>, Error> {
        let mut out = IndexMap::new();
        for (k, v) in pairs {
            let (k2, v2) = self.pair(&k, &v, depth)?;
            out.insert(k2.unwrap_or(k), v2.unwrap_or(v));
        }
        Ok(out)
    }

    fn pair(
        &mut self,
        k: &Value,
        v: &Value,
        depth: usize,
    ) -> Result<(Option<Value>, Option<Value>), Error> {
        self.add_printed(4)?;
        Ok((self.visit(k, depth + 1)?, self.visit(v, depth + 1)?))
    }
}
