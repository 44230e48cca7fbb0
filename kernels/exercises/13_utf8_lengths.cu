// For each of n bytes of UTF-8 text (stored four to an int, little-endian: byte k of a word is
// (word >> 8k) & 255): the length in bytes of the character the byte starts, 1 to 4, read off its leading
// bits, or 0 for a continuation byte (10xxxxxx), which starts none.
extern "C" __global__ void utf8_lengths(int* lengths, const int* words, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int byte = ((unsigned int)words[i / 4] >> (8 * (i % 4))) & 255;
        int length = 0;
        if (byte < 0x80) {
            length = 1;   // 0xxxxxxx: ASCII
        } else if ((byte & 0xE0) == 0xC0) {
            length = 2;   // 110xxxxx: é, and most of the Latin, Greek and Cyrillic letters
        } else if ((byte & 0xF0) == 0xE0) {
            length = 3;   // 1110xxxx: kana, kanji, full-width forms
        } else if ((byte & 0xF8) == 0xF0) {
            length = 4;   // 11110xxx: rare kanji, emoji
        }
        lengths[i] = length;
    }
}
