// One UTF-8 sequence read, checked as Unicode requires: shared by the code-point tokenizer
// (data/Text.cpp) and the byte-level BPE's error messages (data/tokenizer/BpeTokenizer.cpp).
#pragma once

#include <cstddef>

namespace dtrain::data {

/// The length (1-4) of the UTF-8 sequence at bytes[i] (of n), its code point in `cp`; 0 when it
/// is malformed: a stray continuation byte, a sequence cut short, an overlong form, a
/// surrogate or a value past U+10FFFF.
inline int utf8_sequence(const unsigned char* bytes, size_t i, size_t n, char32_t& cp) {
  const unsigned char lead = bytes[i];
  int length = 0;
  if (lead < 0x80) {
    length = 1;
    cp = lead;
  } else if ((lead & 0xE0) == 0xC0) {
    length = 2;
    cp = lead & 0x1F;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3;
    cp = lead & 0x0F;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4;
    cp = lead & 0x07;
  }
  bool ok = length > 0 && i + length <= n;
  for (int k = 1; ok && k < length; ++k) {
    ok = (bytes[i + k] & 0xC0) == 0x80;
    cp = (cp << 6) | (bytes[i + k] & 0x3F);
  }
  static const char32_t kMinimum[] = {0, 0, 0x80, 0x800, 0x10000};
  ok = ok && cp >= kMinimum[length] && cp <= 0x10FFFF && (cp < 0xD800 || cp > 0xDFFF);
  return ok ? length : 0;
}

}  // namespace dtrain::data
